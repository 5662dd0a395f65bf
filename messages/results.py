"""What comes back: token chunks as they are produced, a decode feed's per-request events,
the prefill worker's result and the router's final result of a request."""

from __future__ import annotations

from dataclasses import dataclass

from messages.timings import PhaseTimings
from messages.transfer import TransferHandle


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one request since the previous chunk."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort" on the last chunk
    # Per token, when requested: top alternatives as (token id, logprob), best first.
    logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    produced_at: float = 0.0  # wall clock when the engine emitted it (engine-side latency)


# A decode feed is a lease: its router renews it every FEED_RENEW_S; one not renewed for
# FEED_TIMEOUT_S (the router died: Ray does not cancel a dead caller's stream) ends, and
# the decode engine aborts every request still on it.
FEED_TIMEOUT_S = 10.0
FEED_RENEW_S = 1.0


@dataclass(frozen=True, slots=True)
class LegEvent:
    """One request's news in a decode feed's batch: its new tokens, or the error that ended
    it. `leg_id` is the id the engine serves the request under."""

    leg_id: str
    chunk: TokenChunk | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class PrefillResult:
    handle: TransferHandle
    prefill_s: float  # from arrival at this worker to the blocks being ready


@dataclass(frozen=True, slots=True)
class GenerationResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: PhaseTimings
    prefill_worker: str
    decode_worker: str
    migrations: int = 0
