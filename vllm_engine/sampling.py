"""Our request messages in vLLM's terms, and vLLM's validation errors in ours."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from messages.errors import InvalidRequestError
from messages.requests import SamplingConfig

if TYPE_CHECKING:
    from vllm import SamplingParams


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
        logprobs=sampling.logprobs or None,
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
