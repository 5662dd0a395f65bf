"""One request, end to end: pick a prefill actor, prefill, pick a decode actor, stream.

The caller iterates `generate()`; leaving the iteration early (client cancel, deadline)
cancels whichever Ray task is running, which aborts the request in that engine and frees
its blocks there. A decode actor that dies mid-stream is, by policy, replaced: the request
is resumed (prompt + tokens already streamed) on another decode actor, and the caller sees
one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Literal

import ray
from ray.exceptions import RayActorError

from kv_transfer.handle import TransferHandle
from kv_transfer.layout import TransferBytes
from prefill_worker.worker import PrefillResult
from router import metrics
from router.pools import Member, Pool
from router.timings import LatencySummary, PhaseTimings
from vllm_engine.requests import (
    GenerateRequest,
    ModelLimits,
    SamplingConfig,
    TokenChunk,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterPolicy:
    # A decode actor died mid-stream: resume on another one ("migrate") or end the stream
    # with UNAVAILABLE ("fail"). Transfer failures are vLLM's `load_failure_policy`.
    on_decode_failure: Literal["migrate", "fail"] = "migrate"
    max_migrations: int = 2
    # Prompts shorter than this skip the prefill pool: the decode engine prefills them
    # itself (conditional disaggregation). Raise it (vLLM's own kv_recompute_threshold is
    # 64) where a short prefill costs less than a transfer. At least 3 on CPU hybrids:
    # prefill computes N-1 tokens and vLLM 0.32's CPU conv kernel fails on 1-token prefills.
    local_prefill_below: int = 3


class DecodeFailedError(RuntimeError):
    """The decode actor serving a request died and the policy says not to resume."""


@dataclass(frozen=True, slots=True)
class GenerationResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: PhaseTimings
    prefill_worker: str
    decode_worker: str
    migrations: int = 0


@dataclass(slots=True)
class _Progress:
    """What the caller has been sent so far."""

    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: str = "abort"

    def add(self, chunk: TokenChunk) -> None:
        now = time.perf_counter()
        self.token_ids.extend(chunk.token_ids)
        self.token_times.extend([now] * len(chunk.token_ids))
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason


class Orchestrator:
    def __init__(
        self, prefill: Pool, decode: Pool, limits: ModelLimits, policy: RouterPolicy = RouterPolicy()
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.limits = limits
        self.policy = policy
        # No prefill pool at all: colocated serving (the decode engines prefill locally),
        # the baseline disaggregation is measured against, behind the same router.
        self.colocated = not prefill.members
        # (prefill, decode) actor pairs whose NIXL handshake was done ahead of traffic,
        # with how long that first transfer took.
        self.handshakes: dict[tuple[str, str], float] = {}

    async def refresh(self, poll_timeout_s: float, handshake_timeout_s: float = 30.0) -> None:
        """Poll both pools. An actor that joins (start-up, restart) first completes its NIXL
        handshake with every live actor of the other pool, so no user request pays for it."""
        joining_prefill, joining_decode = await asyncio.gather(
            self.prefill.refresh_loads(poll_timeout_s), self.decode.refresh_loads(poll_timeout_s)
        )
        if not self.colocated:
            decode = [m for m in self.decode.members if m.alive] + joining_decode
            prefill = [m for m in self.prefill.members if m.alive]
            pairs = [(p, d) for p in joining_prefill for d in decode] + [(p, d) for p in prefill for d in joining_decode]
            await asyncio.gather(*(self._handshake(p, d, handshake_timeout_s) for p, d in pairs))
        for member in joining_prefill + joining_decode:
            member.alive = True
        metrics.observe_pool(self.prefill)
        metrics.observe_pool(self.decode)

    async def _handshake(self, prefill: Member, decode: Member, timeout_s: float) -> None:
        request_id = f"handshake-{prefill.name}-{decode.name}-{time.monotonic_ns()}"
        request = GenerateRequest(request_id, tuple(range(1, 17)), SamplingConfig(max_tokens=1))
        started = time.perf_counter()
        try:
            result = await asyncio.wait_for(prefill.actor.prefill.remote(request), timeout_s)
            await asyncio.wait_for(_drain(decode.actor.generate.remote(request, result.handle)), timeout_s)
        except Exception:  # a peer that cannot handshake now will on its first request
            log.warning("pre-warm handshake %s -> %s failed", prefill.name, decode.name, exc_info=True)
            return
        self.handshakes[(prefill.name, decode.name)] = time.perf_counter() - started

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerationResult]:
        arrived = time.perf_counter()
        request.validate(self.limits)  # cheap, and before any engine holds blocks for it
        progress = _Progress()
        first_leg: tuple[PrefillResult | None, float] | None = None  # the leg the timings describe
        migrations = 0
        current = request
        while True:
            local = self.colocated or len(current.prompt_token_ids) < self.policy.local_prefill_below
            prefill_member, prefill = (None, None) if local else await self._prefill(current)
            first_leg = first_leg or (prefill, time.perf_counter())
            decode_member = self.decode.pick_decode()
            try:
                handle = prefill.handle if prefill else None
                async for chunk in self._decode(decode_member, current, handle, progress):
                    yield chunk
                break
            except RayActorError as err:
                decode_member.alive = False
                if self.policy.on_decode_failure == "fail" or migrations >= self.policy.max_migrations:
                    raise DecodeFailedError(
                        f"decode actor {decode_member.name} died while serving {request.request_id}"
                    ) from err
                migrations += 1
                current = request.continued(tuple(progress.token_ids))
                if current.sampling.max_tokens < 1:  # it died after the last token
                    progress.finish_reason = "length"
                    break

        result = GenerationResult(
            finish_reason=progress.finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(progress.token_ids),
            timings=_timings(arrived, *first_leg, progress.token_times),
            prefill_worker=prefill_member.name if prefill_member else "",
            decode_worker=decode_member.name,
            migrations=migrations,
        )
        times = progress.token_times
        metrics.observe_request(result, [b - a for a, b in zip(times, times[1:])])
        yield result

    async def _decode(
        self, member: Member, request: GenerateRequest, handle: TransferHandle | None, progress: _Progress
    ) -> AsyncIterator[TokenChunk]:
        member.outstanding_requests += 1
        stream = member.actor.generate.remote(request, handle)
        finished = False
        try:
            async for ref in stream:
                chunk: TokenChunk = await ref
                progress.add(chunk)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            member.outstanding_requests -= 1
            if not finished:  # caller left early or the actor failed: stop the engine too
                ray.cancel(stream)

    async def _prefill(self, request: GenerateRequest) -> tuple[Member, PrefillResult]:
        """Prefill on the best live actor; an actor that dies meanwhile is marked and skipped."""
        while True:
            member = self.prefill.pick_prefill()  # raises NoWorkerError when none is left
            tokens = len(request.prompt_token_ids)
            member.outstanding_requests += 1
            member.outstanding_prompt_tokens += tokens
            ref = member.actor.prefill.remote(request)
            try:
                return member, await ref
            except RayActorError:
                member.alive = False
            except BaseException:
                ray.cancel(ref)
                raise
            finally:
                member.outstanding_requests -= 1
                member.outstanding_prompt_tokens -= tokens



def _timings(arrived: float, prefill: PrefillResult | None, prefill_done: float, times: list[float]) -> PhaseTimings:
    first = times[0] if times else time.perf_counter()
    span = times[-1] - first if len(times) > 1 else 0.0
    prefill_s = prefill.prefill_s if prefill else 0.0
    return PhaseTimings(
        queue_s=max(0.0, (prefill_done - arrived) - prefill_s),
        prefill_s=prefill_s,
        transfer_s=first - prefill_done if prefill else 0.0,
        ttft_s=first - arrived,
        inter_token=LatencySummary.of([b - a for a, b in zip(times, times[1:])]),
        decode_tokens_per_s=(len(times) - 1) / span if span > 0 else 0.0,
        e2e_s=time.perf_counter() - arrived,
        transfer_bytes=prefill.handle.bytes if prefill else TransferBytes(0, 0),
    )


async def _drain(stream) -> None:  # noqa: ANN001
    async for ref in stream:
        await ref
