"""Our request messages in vLLM's terms; vLLM's outputs and validation errors in ours."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from messages.errors import InvalidRequestError
from messages.requests import SamplingConfig
from messages.results import TokenChunk

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import CompletionOutput


def sampling_params(sampling: SamplingConfig, **overrides: Any) -> "SamplingParams":
    from vllm import SamplingParams

    fields: dict[str, Any] = dict(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else -1,
        seed=sampling.seed,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
    )
    fields.update(overrides)
    try:
        return SamplingParams(**fields)
    except Exception as exc:  # vLLM's own checks, should ours miss one
        raise as_invalid_request(exc) from None


def as_invalid_request(exc: Exception) -> Exception:
    """vLLM's validation errors as ours (INVALID_ARGUMENT naming the field); others unchanged."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(exc, VLLMValidationError):
        return InvalidRequestError(exc.parameter or "request", str(exc))
    return exc


def token_chunk(completion: "CompletionOutput", finish_reason: str | None) -> TokenChunk:
    """One output of a request (its new tokens, with DELTA outputs) as a chunk, stamped now."""
    return TokenChunk(
        tuple(completion.token_ids),
        completion.text,
        finish_reason,
        _top_logprobs(completion.logprobs),
        time.time(),
    )


def _top_logprobs(logprobs) -> tuple[tuple[tuple[int, float], ...], ...]:  # noqa: ANN001
    if not logprobs:
        return ()
    return tuple(
        tuple(sorted(((token, lp.logprob) for token, lp in position.items()), key=lambda t: -t[1]))
        for position in logprobs
    )
