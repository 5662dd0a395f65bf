"""The prefill and decode actor pools and how the router picks from them.

Picking uses what the router already knows exactly and for free (requests it has in
flight on each actor) plus each actor's cheap load report (requests running and waiting,
free KV blocks), refreshed in the background: no per-request round trip to the workers.
Several routers pick independently; the load report is what shows each of them the
others' requests (tests/test_pools.py measures the imbalance without it).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from messages.errors import NoWorkerError
from messages.membership import MemberState
from messages.reports import EngineCapacity, EngineLoad


@dataclass(slots=True)
class Member:
    name: str
    actor: Any  # Ray actor handle
    _outstanding: int = 0  # this router's requests in flight on it (`outstanding_requests`)
    outstanding_prompt_tokens: int = 0
    load: EngineLoad | None = None
    # Picked only while alive: set once it answers (and is handshaken with the other pool),
    # cleared when a load report or a call fails.
    alive: bool = False
    draining: bool = False  # being removed: finishes its requests, never picked again
    engine_id: str = ""  # as last reported; a new one means Ray restarted the actor
    missed_polls: int = 0  # load polls in a row that timed out
    capacity: EngineCapacity | None = None  # reported once the engine is up
    # (when, +1 started / -1 finished) for this router's requests not yet in a load report.
    # Timed, not counted at the report's arrival: a report reaches the router through the
    # controller a poll interval late, and counting then dropped the requests this router
    # started in between (a second router put 4 streams on one engine and 2 on the other).
    _changes: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def outstanding_requests(self) -> int:
        return self._outstanding

    @outstanding_requests.setter
    def outstanding_requests(self, count: int) -> None:
        self._changes.append((time.time(), count - self._outstanding))
        self._outstanding = count

    def record_load(self, load: EngineLoad | None) -> None:
        self.load = load
        while self._changes and (load is None or self._changes[0][0] <= load.measured_at):
            self._changes.popleft()  # in this report already

    @property
    def estimated_requests(self) -> int:
        """Requests on the engine from every router: the last report's running and waiting
        ones, plus what this router started there since it was measured (minus what it
        finished). With one router this is its own in-flight count; with several it includes
        the others'."""
        if self.load is None:
            return self._outstanding
        since_report = sum(change for _, change in self._changes)
        return max(self._outstanding, self.load.running + self.load.waiting + since_report)


@dataclass(slots=True)
class Pool:
    role: str
    members: list[Member] = field(default_factory=list)
    # A busy engine can answer a load poll late (one core, a big batch): dropping it from
    # rotation then would only push its load onto the others. Only this many timeouts in a
    # row (a wedged actor) take it out; a dead actor's error does at once.
    timeouts_before_dead: int = 3
    # Ties rotate, each router from its own random start, so routers that all see idle
    # engines do not all pick the first one.
    _tiebreak: itertools.count = field(default_factory=lambda: itertools.count(random.randrange(1 << 16)))

    def pick_prefill(self) -> Member:
        """Least outstanding prompt tokens: prefill time is proportional to them."""
        live = self._live_members()
        turn = next(self._tiebreak)
        return min(live, key=lambda m: (m.outstanding_prompt_tokens, (live.index(m) - turn) % len(live)))

    def pick_decode(self) -> Member:
        """Fewest requests (from all routers), then most free KV/state capacity."""
        live = self._live_members()
        turn = next(self._tiebreak)
        return min(
            live,
            key=lambda m: (
                m.estimated_requests,
                -(m.load.free_blocks if m.load else 0),
                (live.index(m) - turn) % len(live),
            ),
        )

    def _live_members(self) -> list[Member]:
        live = [m for m in self.members if m.alive]
        if not live:
            raise NoWorkerError(f"no live {self.role} actor: check the cluster's {self.role} nodes")
        return live

    @property
    def has_live_member(self) -> bool:
        return any(m.alive for m in self.members)

    async def refresh_loads(self, timeout_s: float) -> list[Member]:
        """Poll every member's load. One whose actor is gone, or that times out
        `timeouts_before_dead` polls in a row, counts as dead.

        Returns the members that answer but are not alive yet, or answer under a new engine
        id (new, or restarted between two polls): the caller decides when they take traffic.
        """

        async def report(member: Member) -> EngineLoad | TimeoutError | None:
            try:
                return await asyncio.wait_for(member.actor.load.remote(), timeout_s)
            except TimeoutError as late:
                return late
            except Exception:  # actor died or is restarting: do not route to it
                return None

        reports = await asyncio.gather(*(report(m) for m in self.members))
        joining = []
        for member, load in zip(self.members, reports):
            if isinstance(load, TimeoutError):
                member.missed_polls += 1
                if member.missed_polls >= self.timeouts_before_dead:
                    member.alive = False
                continue
            member.missed_polls = 0
            member.record_load(load)
            if load is None:
                member.alive = False
            elif member.draining:
                continue
            elif not member.alive or load.engine_id != member.engine_id:
                member.alive = False  # until the caller has handshaken it
                member.engine_id = load.engine_id
                joining.append(member)
        return joining

    def mirror(self, states: tuple[MemberState, ...], new_poll: bool) -> None:
        """Take membership, liveness and load from the controller's view, keeping what only
        this router knows (its requests in flight on each member). `new_poll`: the loads
        were measured since the last view (else they are not taken as new)."""
        known = {m.name: m for m in self.members}
        members = []
        for state in states:
            member = known.get(state.name) or Member(state.name, state.actor)  # names are never reused
            member.alive, member.draining, member.capacity = state.alive, state.draining, state.capacity
            member.engine_id = state.load.engine_id if state.load else member.engine_id
            if new_poll:
                member.record_load(state.load)
            members.append(member)
        self.members = members  # one that left keeps its object for requests still on it
