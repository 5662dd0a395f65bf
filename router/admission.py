"""Admission control: a bounded number of requests in flight, a bounded FIFO wait queue,
and a fast, explicit refusal past both.

Without it an overloaded router accepts everything, prefills it, and the excess then fails
on decode's transfer timeout: work spent, nothing delivered. Here a request past the queue
is turned away at once (RESOURCE_EXHAUSTED, with a retry hint), while every admitted
request runs to completion: the in-flight bound is the decode pool's batch capacity (the
sum of its engines' max_num_seqs), and vLLM preempts rather than fails when blocks run short.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from typing import AsyncIterator, Callable

from messages.errors import DrainingError, OverloadedError
from messages.membership import AdmissionLimits


class AdmissionController:
    # Smoothing of the mean time a request holds a slot (for the retry hint).
    _EWMA = 0.1

    def __init__(self, limits: Callable[[], AdmissionLimits]) -> None:
        self._limits = limits  # re-read per request: pools grow, shrink and lose actors
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._held_s = 1.0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Hold a slot for the body; waits in line (as long as the caller's deadline allows)."""
        await self._acquire()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._held_s += self._EWMA * (time.perf_counter() - started - self._held_s)
            self._release()

    def limits_changed(self) -> None:
        """Admit waiters the current limits now leave room for (a router's share of the
        tier's limits grows while nothing of its own finishes)."""
        limits = self._limits()
        while self._waiters and self.in_flight < limits.max_in_flight:
            slot = self._waiters.popleft()
            if not slot.done():
                self._take()
                slot.set_result(None)

    def start_draining(self) -> None:
        """Refuse new requests; those admitted or waiting still run."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once nothing is in flight or waiting, False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def _acquire(self) -> None:
        if self.draining:
            raise DrainingError("the server is shutting down: retry on another router")
        limits = self._limits()
        if self.in_flight < limits.max_in_flight and not self._waiters:
            self._take()
            return
        if len(self._waiters) >= limits.max_queue:
            retry_after_s = self._retry_after_s(limits)
            raise OverloadedError(
                f"overloaded: {self.in_flight} requests in flight and {self.waiting} waiting on this router, "
                f"its limits {limits.max_in_flight} and {limits.max_queue}; retry in {retry_after_s:.2f}s",
                retry_after_s,
            )
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        self._idle.clear()
        try:
            await slot  # a finishing request hands its slot over (in_flight stays counted)
        except BaseException:
            if slot.done() and not slot.cancelled():
                self._release()  # handed over just as the caller left: pass it on
            else:
                with contextlib.suppress(ValueError):  # already skipped by a release
                    self._waiters.remove(slot)
                self._set_idle_if_empty()
            raise

    def _take(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _release(self) -> None:
        # Hand the slot to the first waiter, unless the limits shrank below what is in flight.
        while self._waiters and self.in_flight <= self._limits().max_in_flight:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.in_flight -= 1
        self._set_idle_if_empty()

    def _set_idle_if_empty(self) -> None:
        if not self.in_flight and not self._waiters:
            self._idle.set()

    def _retry_after_s(self, limits: AdmissionLimits) -> float:
        """When a slot is likely to be free for a newcomer: the queue ahead of it drains at
        max_in_flight requests per mean holding time."""
        return min(30.0, max(0.05, self._held_s * (len(self._waiters) + 1) / max(1, limits.max_in_flight)))
