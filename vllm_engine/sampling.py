"""Our request messages in vLLM's terms; vLLM's outputs and validation errors in ours."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from messages.errors import InvalidRequestError
from messages.requests import GenerateRequest, SamplingConfig, StructuredOutput
from messages.results import TokenChunk

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.sampling_params import StructuredOutputsParams

# SamplingParams.extra_args key of the tokens a request forces (vllm_engine.teacher_forcing).
FORCED_TOKENS_KEY = "pdserve_forced_tokens"


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
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias) or None,
        allowed_token_ids=list(sampling.allowed_token_ids) if sampling.allowed_token_ids is not None else None,
        bad_words=list(sampling.bad_words),
        min_tokens=sampling.min_tokens,
        include_stop_str_in_output=sampling.include_stop_str_in_output,
        structured_outputs=structured_outputs_params(sampling.structured),
        prompt_logprobs=sampling.prompt_logprobs,
        skip_special_tokens=sampling.skip_special_tokens,
        spaces_between_special_tokens=sampling.spaces_between_special_tokens,
    )
    fields.update(overrides)
    if sampling.forced_tokens:  # beside the connector's extra_args, if any
        fields["extra_args"] = {**(fields.get("extra_args") or {}), FORCED_TOKENS_KEY: list(sampling.forced_tokens)}
    # A prefill leg of one token holds what min_tokens asks of its token; decode's leg gets
    # the rest (GenerateRequest.continued).
    fields["min_tokens"] = min(fields["min_tokens"], fields["max_tokens"])
    try:
        return SamplingParams(**fields)
    except Exception as exc:  # vLLM's own checks, should ours miss one
        raise as_invalid_request(exc) from None


def structured_outputs_params(structured: StructuredOutput | None) -> "StructuredOutputsParams | None":
    from vllm.sampling_params import StructuredOutputsParams

    if structured is None:
        return None
    spec = True if structured.kind == "json_object" else structured.spec
    try:
        return StructuredOutputsParams(
            **{structured.kind: list(spec) if structured.kind == "choice" else spec},
            disable_any_whitespace=structured.disable_any_whitespace,
            disable_additional_properties=structured.disable_additional_properties,
            whitespace_pattern=structured.whitespace_pattern,
        )
    except Exception as exc:
        raise as_invalid_request(exc) from None


def engine_prompt(request: GenerateRequest) -> dict[str, Any]:
    """The request's prompt as vLLM takes it (a TokensPrompt)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
    if request.cache_salt:
        prompt["cache_salt"] = request.cache_salt
    return prompt


def as_invalid_request(exc: Exception) -> Exception:
    """vLLM's validation errors as ours (INVALID_ARGUMENT naming the field); others unchanged."""
    from vllm.exceptions import VLLMValidationError

    if isinstance(exc, VLLMValidationError):
        return InvalidRequestError(exc.parameter or "request", str(exc))
    return exc


def token_chunk(output: "RequestOutput", finish_reason: str | None) -> TokenChunk:
    """One output of a request (its new tokens, with DELTA outputs) as a chunk, stamped now."""
    completion = output.outputs[0]
    logprobs, texts = _top_logprobs(completion.logprobs)
    return TokenChunk(
        tuple(completion.token_ids),
        completion.text,
        finish_reason,
        logprobs,
        time.time(),
        texts,
        output.num_cached_tokens or 0,
        _prompt_logprobs(output.prompt_logprobs),
        _drafts(completion.spec_decode_metrics),
    )


def _drafts(spec) -> tuple[int, int]:  # noqa: ANN001 (vLLM's RequestSpecDecodeMetrics)
    """(proposed, accepted): histogram[j] counts the verify steps that accepted j drafts."""
    if spec is None:
        return ()
    return spec.num_draft_tokens, sum(j * steps for j, steps in enumerate(spec.histogram))


def _prompt_logprobs(positions) -> tuple:  # noqa: ANN001 (vLLM's PromptLogprobs)
    if not positions:
        return ()
    return tuple(
        None if p is None else tuple((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in p.items())
        for p in positions
    )


def _top_logprobs(logprobs) -> tuple[tuple, tuple]:  # noqa: ANN001
    """Best first, with the engine's text of each (the OpenAI front shows vLLM's texts)."""
    if not logprobs:
        return (), ()
    ranked = [sorted(position.items(), key=lambda item: -item[1].logprob) for position in logprobs]
    return (
        tuple(tuple((token, lp.logprob) for token, lp in position) for position in ranked),
        tuple(tuple(lp.decoded_token for _, lp in position) for position in ranked),
    )
