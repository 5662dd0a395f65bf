"""Shadow verification: a sampled share of requests is recomputed colocated, and P/D's tokens
must score the same there.

After a sampled request finishes, the decode engine that served it runs the request again on
its own (prefill and decode in one engine, under a fresh cache salt so none of the
transferred blocks is reused), teacher-forced along the first tokens P/D produced
(vllm_engine.teacher_forcing). Each token's logprob there must equal, within bf16 noise, the
logprob P/D reported for it. A wrong handoff (a corrupted block or state slot, a block table
off by one, another request's state) moves them far past that; a divergence is counted and
logged with the request, the engine pair and the first divergent step. The client's stream
is never changed: the router asks the engines for the emitted tokens' logprobs and keeps
them to itself unless the client asked for logprobs too.

Why a recompute and not only digests of the moved bytes: it also catches what arrives intact
but is used wrongly (block tables, slots, handles), at the cost of one colocated prefill per
checked request, which is why it is sampled.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import uuid
from dataclasses import dataclass, replace
from typing import Any, Sequence

from messages.requests import GenerateRequest
from messages.results import TokenChunk
from router import metrics

log = logging.getLogger(__name__)

# Both computations run vLLM's bf16 kernels (8 significant bits: ~0.04 nats on a logit of
# magnitude 10); an honest difference stays within a few such steps. tests/test_model_matrix.py
# measured none at all on CPU.
TOLERANCE_NATS = 0.05
# Checks one router runs at once; a sampled request finding them all busy goes unchecked
# (counted), so a burst never queues recomputes behind client traffic.
MAX_IN_FLIGHT = 2


@dataclass(frozen=True, slots=True)
class ShadowVerdict:
    request_id: str
    prefill: str
    decode: str
    steps: int  # tokens scored
    first_divergent_step: int | None
    largest_gap_nats: float

    @property
    def agrees(self) -> bool:
        return self.first_divergent_step is None


def emitted_logprobs(chunk: TokenChunk) -> list[float]:
    """The logprob of each token the chunk emits, from its top lists (best first, the emitted
    token always among them); NaN where the engine sent none."""
    if not chunk.logprobs:
        return [math.nan] * len(chunk.token_ids)
    return [dict(top).get(token, math.nan) for token, top in zip(chunk.token_ids, chunk.logprobs)]


def first_divergence(served: Sequence[float], recomputed: Sequence[float]) -> tuple[int | None, float]:
    """(first step whose logprobs differ by more than the tolerance, or None; the largest
    difference). A step P/D reported no logprob for counts as divergent."""
    first, largest = None, 0.0
    for step, (a, b) in enumerate(zip(served, recomputed)):
        gap = abs(a - b) if not (math.isnan(a) or math.isnan(b)) else math.inf
        largest = max(largest, gap)
        if gap > TOLERANCE_NATS and first is None:
            first = step
    return first, largest


def without_logprobs(chunk: TokenChunk) -> TokenChunk:
    """The chunk a client that asked for no logprobs receives."""
    return replace(chunk, logprobs=(), logprob_texts=())


class ShadowVerifier:
    def __init__(self, fraction: float, tokens: int, rng: random.Random | None = None) -> None:
        """`fraction`: share of eligible requests checked; `tokens`: generated tokens scored."""
        self.fraction = fraction
        self.tokens = tokens
        self._rng = rng or random.Random()
        self._running: set[asyncio.Task[None]] = set()
        self.verdicts: collections.deque[ShadowVerdict] = collections.deque(maxlen=64)  # the latest

    def wants(self, request: GenerateRequest) -> bool:
        return self.fraction > 0 and self._rng.random() < self.fraction

    @staticmethod
    def instrumented(request: GenerateRequest) -> GenerateRequest:
        """The request as the engines run it when checked: with the emitted tokens' logprobs."""
        if request.sampling.logprobs is not None:
            return request
        return replace(request, sampling=replace(request.sampling, logprobs=0))

    def start(
        self, request: GenerateRequest, token_ids: list[int], served: list[float], prefill: str, decode: str, actor: Any
    ) -> None:
        """Check in the background (the caller's stream has ended)."""
        if len(self._running) >= MAX_IN_FLIGHT:
            metrics.SHADOW_CHECKS.labels("skipped").inc()
            return
        task = asyncio.ensure_future(self._check(request, token_ids, served, prefill, decode, actor))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def settled(self) -> None:
        """Wait for the checks under way (at shutdown, and in tests)."""
        await asyncio.gather(*self._running, return_exceptions=True)

    async def _check(self, request, token_ids, served, prefill, decode, actor) -> None:  # noqa: ANN001
        try:
            verdict = await verify(actor, request, token_ids[: self.tokens], served[: self.tokens], prefill, decode)
        except Exception as err:  # the engine went away or refused: nothing to conclude
            metrics.SHADOW_CHECKS.labels("error").inc()
            log.warning("shadow check of %s on %s could not run: %s", request.request_id, decode, err)
            return
        self.verdicts.append(verdict)
        metrics.SHADOW_CHECKS.labels("agree" if verdict.agrees else "diverge").inc()
        if not verdict.agrees:
            log.error(
                "shadow check: %s served by %s -> %s diverges from colocated at step %d (%.3f nats)",
                verdict.request_id,
                verdict.prefill,
                verdict.decode,
                verdict.first_divergent_step,
                verdict.largest_gap_nats,
            )


async def decode_on_handle(actor: Any, prefill_result: Any, request: GenerateRequest) -> tuple[list[int], list[float]]:
    """`request` decoded by the decode `actor` on a prefill result's handle (the leg a router
    would run): its tokens and each one's logprob (ask for logprobs in `request`)."""
    chunks = [prefill_result.first] if prefill_result.first else []
    async for ref in actor.generate.remote(prefill_result.decode_leg(request), prefill_result.handle):
        chunks.append(await ref)
    return [t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in emitted_logprobs(c)]


async def verify(
    actor: Any, request: GenerateRequest, token_ids: Sequence[int], served: Sequence[float], prefill: str, decode: str
) -> ShadowVerdict:
    """Recompute `request` on the decode `actor` alone, forced along `token_ids`, and compare
    each token's logprob with `served` (what P/D reported for it)."""
    forced = tuple(token_ids)
    sampling = replace(
        request.sampling,
        max_tokens=len(forced),
        min_tokens=0,
        logprobs=0,
        forced_tokens=forced,
        stop=(),
        stop_token_ids=(),
        bad_words=(),
        structured=None,
        prompt_logprobs=None,
    )
    shadow = replace(
        request, request_id=f"shadow-{uuid.uuid4().hex[:12]}", sampling=sampling, cache_salt=uuid.uuid4().hex
    )
    recomputed: list[float] = []
    async for ref in actor.generate.remote(shadow):
        recomputed.extend(emitted_logprobs(await ref))
    first, largest = first_divergence(served, recomputed)
    return ShadowVerdict(request.request_id, prefill, decode, len(forced), first, largest)
