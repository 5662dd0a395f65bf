"""What a client asks for: the request, its sampling settings and their validation against
the model's limits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from messages.errors import InvalidRequestError

# Caps on what one request may ask of an engine: vLLM checks every stop string on every
# token, on the engine thread that serves the whole batch.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# vLLM's default max_logprobs (and OpenAI's cap on top_logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    # vLLM 0.32's CPU Gated-DeltaNet conv kernel fails on a 1-token prefill, so hybrids on
    # CPU need prompts of 2+ tokens (GPU kernels and attention-only models do not).
    min_prompt_tokens: int = 1


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Per generated token: its logprob and this many top alternatives (0: the token's own
    # only; None: no logprobs at all).
    logprobs: int | None = None

    def validate(self, limits: ModelLimits) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= 2):
            raise InvalidRequestError("temperature", f"must be in [0, 2], got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                "stop_token_ids", f"{bad} outside the vocabulary [0, {limits.vocab_size})"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"{len(self.stop)} stop strings; at most {MAX_STOP_STRINGS}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError("stop", f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "stop_token_ids", f"{len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def validate(self, limits: ModelLimits) -> None:
        n = len(self.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "is empty: give prompt text or at least one token id")
        if n < limits.min_prompt_tokens:
            raise InvalidRequestError(
                "prompt", f"has {n} token(s); this model on this device needs at least {limits.min_prompt_tokens}"
            )
        bad = [t for t in self.prompt_token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                "prompt_token_ids", f"{bad[:5]} outside the vocabulary [0, {limits.vocab_size})"
            )
        self.sampling.validate(limits)
        if n + self.sampling.max_tokens > limits.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{n} prompt tokens + max_tokens {self.sampling.max_tokens} exceed the model's "
                f"maximum length {limits.max_model_len}: shorten the prompt or lower max_tokens",
            )

    def continued(self, generated: tuple[int, ...]) -> "GenerateRequest":
        """This request resumed elsewhere after `generated` tokens were already streamed.

        A seeded request gets a seed of its own for the rest: the resumed engine starts a
        fresh generator, and with the same seed it would draw the same noise again for the
        next token as it drew for the first (a bias towards repeating it). The stream stays
        reproducible per seed, but is not the one an unsplit run of that seed gives."""
        seed = self.sampling.seed
        return replace(
            self,
            prompt_token_ids=self.prompt_token_ids + generated,
            sampling=replace(
                self.sampling,
                max_tokens=self.sampling.max_tokens - len(generated),
                seed=None if seed is None else (seed * 1_000_003 + len(generated)) % 2**63,
            ),
        )
