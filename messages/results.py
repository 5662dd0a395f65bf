"""What comes back: token chunks as they are produced, a worker feed's per-leg events and
the commands that start and stop legs, the prefill worker's result and the router's final
result of a request."""

from __future__ import annotations

from dataclasses import dataclass

from messages.requests import GenerateRequest
from messages.timings import PhaseTimings
from messages.transfer import TransferHandle


class PicklesPositionally:
    """For messages sent once per engine step per request: pickled as (class, field values),
    cheaper to (un)pickle than a slotted dataclass's default, whose state methods walk
    `dataclasses.fields()` for every object."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[object, ...]]:
        return type(self), tuple(getattr(self, name) for name in self.__slots__)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class TokenChunk(PicklesPositionally):
    """New tokens of one request since the previous chunk."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort" on the last chunk
    # Per token, when requested: top alternatives as (token id, logprob), best first.
    logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    produced_at: float = 0.0  # wall clock when the engine emitted it (engine-side latency)
    # The engine's text of each entry of `logprobs` (vLLM's decoded_token), in its order.
    logprob_texts: tuple[tuple[str | None, ...], ...] = ()
    # Prompt tokens the leg's engine did not compute: its prefix-cache hits, plus (on a leg
    # that pulled state) what it pulled. vLLM's num_cached_tokens.
    cached_tokens: int = 0
    # In a request's first chunk, where it asked for them: per prompt token (None for the
    # first, which has no context), entries of (token id, logprob, rank, the engine's text of
    # the token) in vLLM's order, the prompt's own token first.
    prompt_logprobs: tuple[tuple[tuple[int, float, int, str | None], ...] | None, ...] = ()
    # On a leg's last chunk, under speculative decoding: (draft tokens proposed, accepted).
    drafts: tuple[int, int] = ()

    @classmethod
    def joined(cls, chunks: "list[TokenChunk]") -> "TokenChunk":
        """Consecutive chunks of one request as one; `produced_at` is the first one's."""
        return cls(
            token_ids=tuple(t for c in chunks for t in c.token_ids),
            text="".join(c.text for c in chunks),
            finish_reason=chunks[-1].finish_reason,
            logprobs=tuple(p for c in chunks for p in c.logprobs),
            produced_at=chunks[0].produced_at,
            logprob_texts=tuple(p for c in chunks for p in c.logprob_texts),
            cached_tokens=chunks[0].cached_tokens,
            prompt_logprobs=chunks[0].prompt_logprobs,
            drafts=chunks[-1].drafts,
        )


# A worker feed is a lease: its router renews it every FEED_RENEW_S; one not renewed for
# FEED_TIMEOUT_S (the router died: Ray does not cancel a dead caller's stream) ends, and
# the worker aborts every leg still on it.
FEED_TIMEOUT_S = 10.0
FEED_RENEW_S = 1.0
# A worker writes to each feed at least this often, an empty batch when it has nothing
# else: a router tells a quiet engine (busy prefilling a long prompt, or a request queued
# behind others) from a gone one (dead, stuck, or cut off) by whether its feed still speaks.
FEED_HEARTBEAT_S = 1.0
# On a feed's connection (vllm_engine/feed.py <-> router/feeds.py), a frame is the
# payload's length in these many bytes (big-endian), then the pickled payload: from the
# actor, a list of LegEvents (an empty frame first tells the router its feed is open: it may
# start legs on it); from the router, one command (StartLeg, StartPrefill or AbortLeg).
FEED_FRAME_HEADER_BYTES = 4
# The largest frame a worker reads from a router (a StartLeg of a maximum-length prompt is
# a few MiB); a bigger length ends the connection.
FEED_MAX_COMMAND_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class FeedAddress:
    """Where a router reaches a worker actor's feeds, and the secret it says hello with: only
    a caller of the actor (through Ray, the cluster's trusted channel) learns it."""

    host: str
    port: int
    token: str


@dataclass(frozen=True, slots=True)
class LegEvent(PicklesPositionally):
    """One leg's news in a worker feed's batch: its output (a decode leg's new tokens, a
    prefill leg's result), or the error that ended it. `leg_id` is the id the engine serves
    the request under."""

    leg_id: str
    output: LegOutput | None = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class StartLeg(PicklesPositionally):
    """A router's frame on its feed: decode `request` (from the state `handle` names, or
    from its prompt when None) into this feed. A refusal comes back as the leg's error."""

    request: GenerateRequest
    handle: TransferHandle | None = None

    @property
    def leg_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class StartPrefill(PicklesPositionally):
    """A router's frame on its feed: prefill `request` and keep its state for decode; the
    PrefillResult (or why not) comes back in the feed."""

    request: GenerateRequest

    @property
    def leg_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class AbortLeg(PicklesPositionally):
    """A router's frame on its feed: stop `leg_id` (its caller left; its prefill timed out or stalled)."""

    leg_id: str


FeedCommand = StartLeg | StartPrefill | AbortLeg


@dataclass(frozen=True, slots=True)
class PrefillResult:
    handle: TransferHandle
    prefill_s: float  # from arrival at this worker to the blocks being ready
    # The request's first output token, sampled by prefill over the whole prompt; None where
    # decode computes it (kv_transfer/producer.py says when). Its finish_reason is set when
    # that token ends the request: then nothing is decoded and the handle is released.
    first: TokenChunk | None = None
    cached_tokens: int = 0  # prompt tokens the prefill engine found in its prefix cache

    def decode_leg(self, request: GenerateRequest) -> GenerateRequest:
        """What decode runs on `handle`: the prompt, plus the first token if prefill sampled it."""
        return request.continued(self.first.token_ids) if self.first else request


@dataclass(frozen=True, slots=True)
class GenerationResult:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: PhaseTimings
    prefill_worker: str
    decode_worker: str
    migrations: int = 0
    # Prompt tokens served from a prefix cache on the engine that prefilled the prompt.
    cached_tokens: int = 0
    # Speculative decoding: draft tokens the decode engines proposed, and accepted.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


LegOutput = TokenChunk | PrefillResult  # what a decode leg, a prefill leg, sends back
