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
# Per-step work a request adds to the batch it runs in: biased ids, banned words.
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = MAX_STOP_STRINGS
MAX_CACHE_SALT_CHARS = 256
# A structured-output constraint (schema, regex, grammar, choices) is compiled on the engine
# thread before the request's first step.
MAX_STRUCTURED_CHARS = 64 << 10
MAX_CHOICES = 256
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int
    # vLLM 0.32's CPU Gated-DeltaNet conv kernel fails on a 1-token prefill, so hybrids on
    # CPU need prompts of 2+ tokens (GPU kernels and attention-only models do not).
    min_prompt_tokens: int = 1
    # The engines speculate (draft tokens verified in one step): vLLM then runs no custom
    # logits processors (teacher forcing) and ignores min_p and logit_bias.
    speculative: bool = False


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One constraint the output must match: vLLM's StructuredOutputsParams in our terms (the
    engines compile and enforce it with vLLM's own backend)."""

    kind: str  # one of STRUCTURED_KINDS
    # The JSON schema (as JSON text), regex, grammar or structural tag; the choices for
    # "choice"; "" for "json_object" (any JSON object).
    spec: str | tuple[str, ...]
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError("structured_outputs", f"kind {self.kind!r} is not one of {STRUCTURED_KINDS}")
        text = self.spec if isinstance(self.spec, str) else "".join(self.spec)
        if len(text) > MAX_STRUCTURED_CHARS:
            raise InvalidRequestError(
                "structured_outputs",
                f"the {self.kind} constraint has {len(text):,} characters; at most {MAX_STRUCTURED_CHARS:,}",
            )
        if "\x00" in text:
            raise InvalidRequestError("structured_outputs", f"the {self.kind} constraint holds a NUL character")
        if self.kind == "choice" and not 1 <= len(self.spec) <= MAX_CHOICES:
            raise InvalidRequestError("structured_outputs", f"choice: 1 to {MAX_CHOICES} choices, got {len(self.spec)}")


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
    # vLLM's further sampling settings (vllm.SamplingParams), with its defaults and ranges.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None
    # Per prompt token: its logprob and this many top alternatives (None: none). Whoever
    # computes the whole prompt returns them with the request's first chunk.
    prompt_logprobs: int | None = None
    # How the engines detokenize: special tokens kept (tool-call markers some models mark
    # special) and spaced as vLLM's SamplingParams has it.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Teacher forcing (vllm_engine.teacher_forcing): emit these tokens, in order, with the
    # model's own logprobs for each. For equivalence checks; no client API sets it.
    forced_tokens: tuple[int, ...] = ()

    @property
    def decoded_whole(self) -> bool:
        """Whether decode must sample every output token itself, the first included (prefill
        then leaves the last prompt token to decode, kv_transfer/producer.py): decode's checks
        only see its own output, and vLLM's are over the request's whole output for stop
        strings (one may span the first token and the next), bad words (a multi-token word
        looks back across it), presence and frequency penalties (they count output tokens,
        not prompt ones), a seed (its generator draws once per output token, from the
        first) and a structured output (its grammar starts at the first output token, and
        decode's engine holds the grammar's state). Every other setting holds per token, or
        counts prompt and output alike (repetition_penalty), or is counted across the legs
        (min_tokens, max_tokens)."""
        return bool(
            self.stop
            or self.bad_words
            or self.presence_penalty
            or self.frequency_penalty
            or (self.seed is not None and self.temperature > 0)
            or self.structured is not None
        )

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
            raise InvalidRequestError("stop_token_ids", f"{bad} outside the vocabulary [0, {limits.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"{len(self.stop)} stop strings; at most {MAX_STOP_STRINGS}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError("stop", f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"{len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        bad = [t for t in self.forced_tokens if not 0 <= t < limits.vocab_size]
        if bad or len(self.forced_tokens) > self.max_tokens:
            raise InvalidRequestError(
                "forced_tokens", f"at most max_tokens ids in [0, {limits.vocab_size}); got {len(self.forced_tokens)}"
            )
        if limits.speculative:
            for name, value in (
                ("min_p", self.min_p),
                ("logit_bias", self.logit_bias),
                ("forced_tokens", self.forced_tokens),
            ):
                if value:
                    raise InvalidRequestError(
                        name, "not applied by engines that decode speculatively (--speculative-method): leave it unset"
                    )
        self._validate_vllm_extras(limits)

    def _validate_vllm_extras(self, limits: ModelLimits) -> None:
        """vLLM's ranges (SamplingParams._verify_args), checked here so that both fronts name
        the field; the vocabulary checks are the engine's input processor's."""
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError("repetition_penalty", f"must be > 0 (1: off), got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"{len(self.logit_bias)} ids; at most {MAX_LOGIT_BIAS}")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError("logit_bias", f"ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise InvalidRequestError("logit_bias", "biases must be in [-100, 100]")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "is empty: give at least one id, or leave it out")
            bad = [t for t in self.allowed_token_ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise InvalidRequestError(
                    "allowed_token_ids", f"ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"
                )
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError("bad_words", f"{len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        if any(not w or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
            raise InvalidRequestError("bad_words", f"each word must be 1 to {MAX_STOP_STRING_CHARS} characters")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.structured is not None:
            self.structured.validate()


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # vLLM's cache_salt: prompts with different salts never share prefix-cache blocks
    # (tenants that must not learn from each other's timing); both legs carry it.
    cache_salt: str = ""

    def validate(self, limits: ModelLimits) -> None:
        n = len(self.prompt_token_ids)
        if len(self.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(
                "cache_salt", f"{len(self.cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}"
            )
        if n == 0:
            raise InvalidRequestError("prompt", "is empty: give prompt text or at least one token id")
        if n < limits.min_prompt_tokens:
            raise InvalidRequestError(
                "prompt", f"has {n} token(s); this model on this device needs at least {limits.min_prompt_tokens}"
            )
        bad = [t for t in self.prompt_token_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"{bad[:5]} outside the vocabulary [0, {limits.vocab_size})")
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
        reproducible per seed, but is not the one an unsplit run of that seed gives. (A first
        token that prefill samples is never seeded: SamplingConfig.decoded_whole.)
        min_tokens counts the tokens already generated, as max_tokens does; prompt logprobs,
        sent with the first token, are not asked for again once there is one."""
        seed = self.sampling.seed
        return replace(
            self,
            prompt_token_ids=self.prompt_token_ids + generated,
            sampling=replace(
                self.sampling,
                max_tokens=self.sampling.max_tokens - len(generated),
                min_tokens=max(0, self.sampling.min_tokens - len(generated)),
                seed=None if seed is None else (seed * 1_000_003 + len(generated)) % 2**63,
                prompt_logprobs=self.sampling.prompt_logprobs if not generated else None,
                forced_tokens=self.sampling.forced_tokens[len(generated) :],
            ),
        )
