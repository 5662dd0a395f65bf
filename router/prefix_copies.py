"""This router's copy of each engine's prefix index: what every engine of a pool holds of a
prompt, found here without asking any engine. Asking per request waited for each engine's
actor, which shares its core with the engine's steps, and cost cache-aware routing ~10 ms of
TTFT under load against cache-blind routing (docs/benchmarks.md); a copy costs one hash of
the prompt and set lookups.

A thread per engine follows its index (`EngineWorker.prefix_index_changes`, a Ray long poll):
changes in order, or the whole index when the copy starts, the engine restarted or its index
started again. A copy not ready yet, or whose engine cannot be reached, counts as holding
nothing (routing under-predicts, never over); it follows again once the engine answers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Sequence

import ray

from cluster.pools import Member
from kv_transfer.layout import StateLayout
from messages.reports import BlockKey, PrefixHit
from router import metrics
from vllm_engine.prefix_index import BlockHashing, PrefixIndex

log = logging.getLogger(__name__)

_POLL_S = 2.0  # longest one long poll waits for a change
# Shortest time from one poll to the next, so that a burst's engine steps answer one poll
# between them, not one each: every answer is a Ray call in the engine actor's process beside
# its steps, and one per step slowed cold-prompt bursts (docs/benchmarks.md). A lone change
# still comes at once; in a burst the copy lags by up to this much.
_POLL_GAP_S = 0.3
_RETRY_S = 1.0  # before following again an engine that could not be reached
_FORGET_S = 60.0  # before dropping the copy of an engine that could not be reached


class _Copy:
    """One engine's index, followed on a thread of its own (not the router's event loop: its
    callers' loops come and go, and a blocking Ray call costs that loop nothing)."""

    def __init__(self, member: Member) -> None:
        self.name = member.name
        self.actor: Any = member.actor
        self.index = PrefixIndex()
        self.spec: tuple[BlockHashing, StateLayout] | None = None
        self.ready = threading.Event()  # the engine answered: `spec` (None: caching off) and `index`
        self.failed_at: float | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._follow, name=f"pdserve-index-copy-{self.name}", daemon=True)
        self._thread.start()

    def stale(self, member: Member, now: float) -> bool:
        """Follow `member` anew: its actor changed, or it could not be reached a while ago."""
        failed = self.failed_at is not None and now - self.failed_at > _RETRY_S
        return member.actor != self.actor or failed

    def stop(self) -> None:
        self._stopping = True

    def _follow(self) -> None:
        try:
            self.spec = ray.get(self.actor.prefix_index_spec.remote())
            self.ready.set()
            while self.spec is not None and not self._stopping:
                index = self.index
                asked = time.monotonic()
                update = ray.get(self.actor.prefix_index_changes.remote(index.generation, index.version, _POLL_S))
                if update is not None:
                    index.follow(update)
                    time.sleep(max(0.0, asked + _POLL_GAP_S - time.monotonic()))
        except Exception as err:  # noqa: BLE001 (the actor died or restarts; Ray shut down)
            log.info("prefix index copy of %s stopped (%s): it counts as holding nothing", self.name, err)
            self.spec, self.index = None, PrefixIndex()
            self.failed_at = time.monotonic()
            self.ready.set()


class PrefixCopies:
    """Every engine's index copy, by member name; `hits` answers for a pool's live members."""

    def __init__(self) -> None:
        self._copies: dict[str, _Copy] = {}

    def follow(self, members: Sequence[Member]) -> None:
        """Start (or restart) the copies of `members`, so they are ready by their first request."""
        now = time.monotonic()
        for member in members:
            copy = self._copies.get(member.name)
            if copy is None or copy.stale(member, now):
                if copy is not None:
                    copy.stop()
                self._copies[member.name] = _Copy(member)
        # Engines removed from their pool leave copies that stopped: forget them.
        for name in [n for n, c in self._copies.items() if c.failed_at is not None and now - c.failed_at > _FORGET_S]:
            del self._copies[name]

    async def hits(
        self, members: Sequence[Member], prompt: Sequence[int], cache_salt: str, state_pulled: bool, wait_s: float
    ) -> dict[str, PrefixHit]:
        """What each of `members` holds of the prompt, by name; a copy still starting is waited
        for up to `wait_s`, then counts as holding nothing."""
        self.follow(members)
        copies = [self._copies[m.name] for m in members]
        deadline = time.monotonic() + wait_s
        while not all(c.ready.is_set() for c in copies) and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        keys: dict[BlockHashing, list[BlockKey]] = {}  # engines of a pool share one way of hashing
        answers = {}
        for copy in copies:
            if not copy.ready.is_set():
                metrics.PREFIX_COPIES_UNREADY.inc()
                continue
            if (spec := copy.spec) is None:  # caching off there, or out of reach
                continue
            hashing, layout = spec
            if hashing not in keys:
                keys[hashing] = hashing.hashes(prompt, cache_salt)
            answers[copy.name] = copy.index.hit(keys[hashing], len(prompt), layout, state_pulled)
        return answers

    def close(self) -> None:
        """Stop every copy; `hits` or `follow` starts them again."""
        for copy in self._copies.values():
            copy.stop()
        self._copies.clear()
