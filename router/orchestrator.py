"""One request, end to end: pick a prefill actor, prefill, pick a decode actor, stream.

The caller iterates `generate()`; leaving the iteration early (client cancel, deadline)
cancels whichever Ray task is running, which aborts the request in that engine and frees
its blocks there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

import ray

from router.pools import Member, Pool
from router.timings import LatencySummary, PhaseTimings
from vllm_engine.requests import GenerateRequest, ModelLimits, TokenChunk


@dataclass(frozen=True, slots=True)
class GenerationResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: PhaseTimings
    prefill_worker: str
    decode_worker: str


class Orchestrator:
    def __init__(self, prefill: Pool, decode: Pool, limits: ModelLimits) -> None:
        self.prefill = prefill
        self.decode = decode
        self.limits = limits

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk | GenerationResult]:
        arrived = time.perf_counter()
        request.validate(self.limits)  # cheap, and before any engine holds blocks for it
        prefill_member = self.prefill.pick_prefill()
        result = await self._prefill(prefill_member, request)
        prefill_done = time.perf_counter()

        decode_member = self.decode.pick_decode()
        decode_member.outstanding_requests += 1
        stream = decode_member.actor.generate.remote(request, result.handle)
        token_times: list[float] = []
        completion_tokens = 0
        finish_reason = "abort"
        try:
            async for ref in stream:
                chunk: TokenChunk = await ref
                now = time.perf_counter()
                token_times.extend([now] * len(chunk.token_ids))
                completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    finish_reason = chunk.finish_reason
                yield chunk
        finally:
            decode_member.outstanding_requests -= 1
            if finish_reason == "abort":  # the caller left early: stop the engine too
                ray.cancel(stream)

        first = token_times[0] if token_times else time.perf_counter()
        gaps = [b - a for a, b in zip(token_times, token_times[1:])]
        decode_span = token_times[-1] - first if len(token_times) > 1 else 0.0
        yield GenerationResult(
            finish_reason=finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=completion_tokens,
            timings=PhaseTimings(
                queue_s=max(0.0, (prefill_done - arrived) - result.prefill_s),
                prefill_s=result.prefill_s,
                transfer_s=first - prefill_done,
                ttft_s=first - arrived,
                inter_token=LatencySummary.of(gaps),
                decode_tokens_per_s=(len(token_times) - 1) / decode_span if decode_span > 0 else 0.0,
                e2e_s=time.perf_counter() - arrived,
                transfer_bytes=result.handle.bytes,
            ),
            prefill_worker=prefill_member.name,
            decode_worker=decode_member.name,
        )

    async def _prefill(self, member: Member, request: GenerateRequest):
        tokens = len(request.prompt_token_ids)
        member.outstanding_requests += 1
        member.outstanding_prompt_tokens += tokens
        ref = member.actor.prefill.remote(request)
        try:
            return await ref
        except BaseException:
            ray.cancel(ref)
            raise
        finally:
            member.outstanding_requests -= 1
            member.outstanding_prompt_tokens -= tokens
