"""The prefill and decode actor pools and how the router picks from them.

Picking uses what the router already knows exactly and for free (requests it has in
flight on each actor) plus each actor's cheap load report (requests running and waiting,
free KV blocks), refreshed in the background: no per-request round trip to the workers.
Several routers pick independently; the load report is what shows each of them the
others' requests (tests/test_pools.py measures the imbalance without it).

A member's `Lifecycle` changes only through its `mark_*` methods, which refuse illegal
transitions; the pools' owner (controller/) makes the transitions of record, a router's
mirror copies them (`Pool.mirror`). A request's share of a member's load is counted by
`async with pool.in_flight(member)`, and every pick returns a `RouteDecision`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

from messages.errors import NoWorkerError
from messages.membership import Lifecycle, MemberState
from messages.reports import EngineCapacity, EngineLoad, PrefixHit

log = logging.getLogger(__name__)

JOINING, LIVE, DRAINING, DEAD = Lifecycle.JOINING, Lifecycle.LIVE, Lifecycle.DRAINING, Lifecycle.DEAD
_NO_HIT = PrefixHit()  # an engine not asked, or that did not answer in time

# Where each state may go. Only a handshake (JOINING) leads to LIVE; a leaving member comes
# back only as one joining the other pool (a role switch). Going to the state a member is
# in already changes nothing: several failed calls may report one death.
_NEXT: dict[Lifecycle, frozenset[Lifecycle]] = {
    JOINING: frozenset({LIVE, DRAINING, DEAD}),
    LIVE: frozenset({JOINING, DRAINING, DEAD}),  # JOINING: Ray restarted it (a new engine id)
    DRAINING: frozenset({JOINING}),
    DEAD: frozenset({JOINING, DRAINING}),
}


class LifecycleError(RuntimeError):
    """A transition the lifecycle does not have (a bug in whoever asked for it)."""


@dataclass(slots=True)
class Member:
    name: str
    actor: Any  # Ray actor handle
    _lifecycle: Lifecycle = field(default=JOINING, init=False)  # read `lifecycle`, change by mark_*
    _outstanding: int = field(default=0, init=False)  # this router's requests in flight on it
    _prompt_tokens: int = field(default=0, init=False)  # their prompt tokens
    load: EngineLoad | None = None
    engine_id: str = ""  # as last reported; a new one means Ray restarted the actor
    missed_polls: int = 0  # load polls in a row that timed out
    capacity: EngineCapacity | None = None  # reported once the engine is up
    # This router's feed on it (a decode engine), whose requests its load reports count apart.
    feed: str | None = None
    # (when, +1 started / -1 finished) for this router's requests not yet in a load report.
    # Timed against when the engine measured the report, not when it arrived: it reaches the
    # router through the controller a poll interval late, and requests started meanwhile
    # must still count.
    _changes: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))

    @property
    def lifecycle(self) -> Lifecycle:
        return self._lifecycle

    @property
    def live(self) -> bool:
        return self._lifecycle is LIVE

    def mark_joining(self) -> None:
        """It answers (started, restarted, back, or moved to this pool): handshake it next."""
        self._become(JOINING, "answers")

    def mark_live(self) -> None:
        """Handshaken with the other pool: it takes traffic."""
        self._become(LIVE, "handshaken")

    def mark_draining(self) -> None:
        """Leaving its pool: it finishes its requests and is never picked again."""
        self._become(DRAINING, "leaving its pool")

    def mark_dead(self, reason: str) -> None:
        """A call or load poll failed: out of rotation until it answers again. A leaving
        member stays leaving: marked dead, its next answer would make it rejoin."""
        if self._lifecycle is not DRAINING:
            self._become(DEAD, reason)

    def mirror_lifecycle(self, lifecycle: Lifecycle) -> None:
        """A router takes the owner's word as it stands: it sees only where transitions
        led, a view apart (DEAD, then LIVE again after a restart's handshake)."""
        self._lifecycle = lifecycle

    def _become(self, lifecycle: Lifecycle, reason: str) -> None:
        if lifecycle is self._lifecycle:
            return
        if lifecycle not in _NEXT[self._lifecycle]:
            raise LifecycleError(f"{self.name}: no transition {self._lifecycle.value} -> {lifecycle.value} ({reason})")
        log.info("%s: %s -> %s (%s)", self.name, self._lifecycle.value, lifecycle.value, reason)
        self._lifecycle = lifecycle

    @property
    def outstanding_requests(self) -> int:
        return self._outstanding

    @property
    def outstanding_prompt_tokens(self) -> int:
        return self._prompt_tokens

    def _count(self, requests: int, prompt_tokens: int) -> None:
        """Only `InFlight` calls this: every +1 is paired with its -1."""
        if requests:
            self._changes.append((time.time(), requests))
        self._outstanding += requests
        self._prompt_tokens += prompt_tokens

    def record_load(self, load: EngineLoad | None) -> None:
        self.load = load
        while self._changes and (load is None or self._changes[0][0] <= load.measured_at):
            self._changes.popleft()  # in this report already

    @property
    def estimated_requests(self) -> int:
        """Requests on the engine from every router: the others' as the last report counted
        them, plus this router's in flight. With one router this is its own in-flight count."""
        if self.load is None:
            return self._outstanding
        if self.feed is not None:
            # The report names this router's requests, so none is lost or counted twice however
            # long one took to reach the engine after the router counted it. The others' are
            # the engine's counts less this router's, and at least their feeds' requests: a
            # leg is in its feed's count before the engine takes it (at its next step), and
            # subtracted from counts that lack it, it would hide another router's request.
            counted = self.load.running + self.load.waiting - self.load.requests_from(self.feed)
            return max(0, counted, self.load.requests_from_others(self.feed)) + self._outstanding
        # Without a feed (a prefill engine): the report's, plus what this router started
        # since it was measured, minus what it finished. A request that reaches the engine
        # after the measurement yet was started before it is missed until the next report.
        since_report = sum(change for _, change in self._changes)
        return max(self._outstanding, self.load.running + self.load.waiting + since_report)


class InFlight:
    """One request's share of a member's load, counted from entry to exit whatever ends it
    (an error, a cancellation, a client that left). Its prompt tokens (those the engine must
    compute) count until `prefilled()`: after its first token the prompt costs nothing more."""

    __slots__ = ("member", "prompt_tokens")

    def __init__(self, member: Member, prompt_tokens: int) -> None:
        self.member = member
        self.prompt_tokens = prompt_tokens

    async def __aenter__(self) -> InFlight:
        self.member._count(1, self.prompt_tokens)
        return self

    def prefilled(self) -> None:
        self.member._count(0, -self.prompt_tokens)
        self.prompt_tokens = 0

    async def __aexit__(self, *exc_info: object) -> None:
        self.member._count(-1, -self.prompt_tokens)  # no await before it: a cancel cannot skip it


RouteReason = Literal["only live member", "least loaded", "tie, taken in turn"]


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One pick and the figures it was made on: the router logs it (debug) and counts it by
    reason (metrics); tests read it."""

    pool: str
    member: Member
    reason: RouteReason
    live: int  # members it was picked among
    requests: int  # its estimated requests, every router's (decode's first key)
    prompt_tokens: int  # this router's outstanding prompt tokens on it (prefill's key)
    free_blocks: int | None  # from its last load report
    cached_tokens: int | None = None  # of this prompt, in its prefix cache (prefill, when asked)

    def __str__(self) -> str:
        cached = "" if self.cached_tokens is None else f", {self.cached_tokens} of the prompt cached"
        return (
            f"{self.pool} pick {self.member.name} ({self.reason} of {self.live}): {self.requests} requests, "
            f"{self.prompt_tokens} prompt tokens, {self.free_blocks} free blocks{cached}"
        )


@dataclass(slots=True)
class Pool:
    role: str
    members: list[Member] = field(default_factory=list)
    # A busy engine can answer a load poll late (one core, a big batch, a host at a load
    # average of 10 and more): dropping it from rotation then would only push its load onto
    # the others, or fail requests while it was the only one. Only this many timeouts in a
    # row (a wedged actor: ~15 s at the controller's 0.5-s interval and 2-s timeout) take it
    # out; a dead actor's error does at once. Three (~7.5 s) took an idle engine out on a
    # 2-core box running another test suite beside it.
    timeouts_before_dead: int = 6
    # Ties rotate, each router from its own random start, so routers that all see idle
    # engines do not all pick the first one.
    _tiebreak: itertools.count = field(default_factory=lambda: itertools.count(random.randrange(1 << 16)))

    def pick_prefill(
        self, prompt_tokens: int = 0, cached: Mapping[str, PrefixHit] | None = None, stream_weight: float = 0.0
    ) -> RouteDecision:
        """Least prefill work: the prompt tokens it must compute (those not in its prefix
        cache, where `cached` says, by member name) plus those queued on it to compute; prefill
        time is proportional to them. `stream_weight` (engines that also decode: colocated, a
        decode engine prefilling): each request on the engine adds that share of the tokens
        to compute, since its stream waits out the new prompt's prefill steps. Without it a
        small hit (a shared system prompt) would draw every request to one engine while the
        other idles. Of equal work, the one holding the longest attention prefix: it keeps a
        hybrid's state checkpoint there for the next request (PrefixHit); then the fewest
        requests."""
        cached = cached or {}

        def work(m: Member) -> tuple[int, ...]:
            hit = cached.get(m.name, _NO_HIT)
            uncached = prompt_tokens - hit.tokens
            stalled = round(stream_weight * uncached * m.estimated_requests)
            return (uncached + m.outstanding_prompt_tokens + stalled, -hit.attention_tokens, m.estimated_requests)

        decision = self._pick(work)
        if not cached:
            return decision
        return dataclasses.replace(decision, cached_tokens=cached.get(decision.member.name, _NO_HIT).tokens)

    def pick_decode(self, cached: Mapping[str, PrefixHit] | None = None, slack: int = 1) -> RouteDecision:
        """Fewest requests (from all routers), then most free KV/state capacity. With
        `cached` (what each holds of the prompt, by name): the one holding the most among
        those within `slack` requests of the fewest, since a decode step costs little more
        per extra stream while a hit moves and computes less (a conversation's next turn);
        then the longest attention prefix, where a hybrid's state checkpoint will be kept."""
        if not cached:
            return self._pick(lambda m: (m.estimated_requests, -(m.load.free_blocks if m.load else 0)))
        fewest = min((m.estimated_requests for m in self.live), default=0)

        def key(m: Member) -> tuple[int, ...]:
            near = m.estimated_requests <= fewest + slack
            hit = cached.get(m.name, _NO_HIT) if near else _NO_HIT
            free = m.load.free_blocks if m.load else 0
            return (0 if near else 1, -hit.tokens, -hit.attention_tokens, m.estimated_requests, -free)

        decision = self._pick(key)
        return dataclasses.replace(decision, cached_tokens=cached.get(decision.member.name, _NO_HIT).tokens)

    def _pick(self, load_key: Callable[[Member], tuple[int, ...]]) -> RouteDecision:
        """The live member of least `load_key`; ties rotate. No I/O: it reads what is known."""
        live = self.live
        if not live:
            raise NoWorkerError(f"no live {self.role} actor: check the cluster's {self.role} nodes")
        turn = next(self._tiebreak)
        keys = [load_key(m) for m in live]
        best = min(range(len(live)), key=lambda i: (keys[i], (i - turn) % len(live)))
        member = live[best]
        reason: RouteReason = "least loaded" if keys.count(keys[best]) == 1 else "tie, taken in turn"
        if len(live) == 1:
            reason = "only live member"
        return RouteDecision(
            self.role,
            member,
            reason,
            len(live),
            member.estimated_requests,
            member.outstanding_prompt_tokens,
            member.load.free_blocks if member.load else None,
        )

    def in_flight(self, member: Member, prompt_tokens: int = 0) -> InFlight:
        """`async with pool.in_flight(member, prompt_tokens=...)`: counts one request (and its
        prompt tokens) on `member` while the block runs, and always takes it back."""
        return InFlight(member, prompt_tokens)

    @property
    def live(self) -> list[Member]:
        return [m for m in self.members if m.live]

    @property
    def staying(self) -> list[Member]:
        """Every member but those draining out of it."""
        return [m for m in self.members if m.lifecycle is not DRAINING]

    @property
    def has_live_member(self) -> bool:
        return any(m.live for m in self.members)

    async def refresh_loads(self, timeout_s: float) -> list[Member]:
        """Poll every member's load. One whose actor is gone, or that times out
        `timeouts_before_dead` polls in a row, counts as dead.

        Returns the members that answer but are not live yet, or answer under a new engine
        id (new, or restarted between two polls), as JOINING: the caller handshakes them and
        decides when they take traffic.
        """

        async def report(member: Member) -> EngineLoad | TimeoutError | None:
            try:
                return await asyncio.wait_for(member.actor.load.remote(), timeout_s)
            except TimeoutError as late:
                return late
            except Exception:  # actor died or is restarting: do not route to it
                return None

        # The members polled, not `self.members` after the wait: a resize may take one out
        # (a role switch) or add one meanwhile, and a report must go to the member it is from.
        polled = list(self.members)
        reports = await asyncio.gather(*(report(m) for m in polled))
        joining = []
        still_here = {id(m) for m in self.members}
        for member, load in zip(polled, reports):
            if id(member) not in still_here:  # moved out while polled: its new pool polls it
                continue
            if isinstance(load, TimeoutError):
                member.missed_polls += 1
                if member.missed_polls >= self.timeouts_before_dead:
                    member.mark_dead(f"{member.missed_polls} load polls in a row timed out")
                continue
            member.missed_polls = 0
            member.record_load(load)
            if load is None:
                member.mark_dead("its load poll failed")
            elif member.lifecycle is DRAINING:
                continue
            elif not member.live or load.engine_id != member.engine_id:
                member.mark_joining()  # until the caller has handshaken it
                member.engine_id = load.engine_id
                joining.append(member)
        return joining

    def mirror(self, states: tuple[MemberState, ...], new_poll: bool) -> None:
        """Take membership, lifecycle and load from the controller's view, keeping what only
        this router knows (its requests in flight on each member). `new_poll`: the loads
        were measured since the last view (else they are not taken as new)."""
        known = {m.name: m for m in self.members}
        members = []
        for state in states:
            member = known.get(state.name) or Member(state.name, state.actor)  # names are never reused
            member.mirror_lifecycle(state.lifecycle)
            member.capacity = state.capacity
            member.engine_id = state.load.engine_id if state.load else member.engine_id
            if new_poll:
                member.record_load(state.load)
            members.append(member)
        self.members = members  # one that left keeps its object for requests still on it
