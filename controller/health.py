"""Keeping the pools healthy: poll every engine's load, and pre-warm every new engine's NIXL
handshake with the other pool before it takes traffic.

Run by whoever owns the pools: the controller actor in `pdserve serve`, or an in-process
router (demo, tests, benchmarks) that owns its own deployment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from messages.membership import Lifecycle
from messages.requests import GenerateRequest, SamplingConfig
from router import metrics
from cluster.pools import Member, Pool

log = logging.getLogger(__name__)


class PoolHealth:
    def __init__(self, prefill: Pool, decode: Pool) -> None:
        self.prefill = prefill
        self.decode = decode
        # (prefill, decode) actor pairs whose NIXL handshake was done ahead of traffic,
        # with how long that first transfer took.
        self.handshakes: dict[tuple[str, str], float] = {}
        self.polls = 0  # completed refreshes: routers mirroring a view tell new loads by it

    async def refresh(self, poll_timeout_s: float, handshake_timeout_s: float = 30.0) -> None:
        """Poll both pools. An actor that joins (start-up, restart) first completes its NIXL
        handshake with every live actor of the other pool, so no user request pays for it."""
        joining_prefill, joining_decode = await asyncio.gather(
            self.prefill.refresh_loads(poll_timeout_s), self.decode.refresh_loads(poll_timeout_s)
        )
        if self.prefill.members:  # colocated serving has no prefill pool and no transfers
            decode = self.decode.live + joining_decode
            prefill = self.prefill.live
            pairs = [(p, d) for p in joining_prefill for d in decode] + [
                (p, d) for p in prefill for d in joining_decode
            ]
            await asyncio.gather(*(self._handshake(p, d, handshake_timeout_s) for p, d in pairs))
        for pool, joining in ((self.prefill, joining_prefill), (self.decode, joining_decode)):
            for member in joining:
                # Not one that a resize took out (or moved to the other pool, where it joins
                # anew) or a failed call marked dead meanwhile.
                if member.lifecycle is Lifecycle.JOINING and any(m is member for m in pool.members):
                    member.mark_live()
        self.polls += 1
        metrics.observe_pool(self.prefill)
        metrics.observe_pool(self.decode)

    async def _handshake(self, prefill: Member, decode: Member, timeout_s: float) -> None:
        request_id = f"handshake-{prefill.name}-{decode.name}-{time.monotonic_ns()}"
        # Two tokens: the first may come from prefill, and decode must still run a step.
        request = GenerateRequest(request_id, tuple(range(1, 17)), SamplingConfig(max_tokens=2, ignore_eos=True))
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(prefill.actor.prefill.remote(request), timeout_s)
            leg = result.decode_leg(request)
            await asyncio.wait_for(_drain(decode.actor.generate.remote(leg, result.handle)), timeout_s)
        except Exception:  # a peer that cannot handshake now will on its first request
            log.warning("pre-warm handshake %s -> %s failed", prefill.name, decode.name, exc_info=True)
            return
        self.handshakes[(prefill.name, decode.name)] = time.perf_counter() - started


async def _drain(stream: AsyncIterator) -> None:
    async for ref in stream:
        await ref
