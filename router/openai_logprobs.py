"""Token logprobs in OpenAI's shapes (completions' `tokens/token_logprobs/top_logprobs/
text_offset`, chat's `content[].top_logprobs`, the Responses API's output_text logprobs),
formatted by vLLM's own serving code.

vLLM formats them in methods of its serving classes, which read nothing of the server but the
`return_tokens_as_token_ids` flag and each other; `_VLLMFormat` borrows them unchanged, so the
entries, their count (completions: the sampled token and `logprobs` others, as OpenAI defines
it; chat: the first `top_logprobs` of the engine's dict) and the -9999 floor are vLLM's.
"""

from __future__ import annotations

from typing import Any

from messages.results import TokenChunk


def _vllm_format() -> type:
    from inspect import getattr_static

    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses

    class _VLLMFormat:
        # As declared there (a staticmethod stays one).
        _get_decoded_token = getattr_static(GenerateBaseServing, "_get_decoded_token")
        _get_top_logprobs = getattr_static(OpenAIServingChat, "_get_top_logprobs")
        completion = getattr_static(OpenAIServingCompletion, "_create_completion_logprobs")
        chat = getattr_static(OpenAIServingChat, "_create_chat_logprobs")
        _topk_logprobs = getattr_static(OpenAIServingResponses, "_topk_logprobs")
        responses = getattr_static(OpenAIServingResponses, "_create_response_logprobs")

        def __init__(self, as_token_ids: bool) -> None:
            self.return_tokens_as_token_ids = as_token_ids

    return _VLLMFormat


_FORMAT: type | None = None


def _as_vllm(chunk: TokenChunk) -> list[dict[int, Any]]:
    """The chunk's entries as the engine's dicts: the sampled token first, then the others by
    rank (the order vLLM's formatting counts in; a chunk keeps them best first)."""
    from vllm.logprobs import Logprob

    positions: list[dict[int, Any] | None] = []
    for i, token in enumerate(chunk.token_ids):
        if i >= len(chunk.logprobs):  # none came for it (vLLM's formatting shows null)
            positions.append(None)
            continue
        entries = chunk.logprobs[i]
        texts = chunk.logprob_texts[i] if i < len(chunk.logprob_texts) else (None,) * len(entries)
        ranked = {t: Logprob(lp, rank, text) for rank, ((t, lp), text) in enumerate(zip(entries, texts), 1)}
        sampled = ranked.pop(token)
        positions.append({token: sampled, **ranked})
    return positions


def vllm_prompt_logprobs(positions: tuple) -> list[dict[int, Any] | None]:
    """A chunk's prompt logprobs as vLLM's engine gives them (its dict order, its ranks), with
    -inf as -9999.0 (vLLM's clamp_prompt_logprobs: JSON has no infinity)."""
    from vllm.logprobs import Logprob

    return [
        None if entries is None else {t: Logprob(max(lp, -9999.0), rank, text) for t, lp, rank, text in entries}
        for entries in positions
    ]


class LogprobsFormatter:
    """One request's logprobs, chunk by chunk (`top`: the alternatives it asked for)."""

    def __init__(self, tokenizer: Any, top: int, as_token_ids: bool) -> None:
        global _FORMAT
        _FORMAT = _FORMAT or _vllm_format()
        self._format = _FORMAT(bool(as_token_ids))
        self._tokenizer = tokenizer
        self._top = top
        self._text_offset = 0  # completions: where the next chunk's text starts

    def completion(
        self, chunk: TokenChunk, echo_ids: tuple[int, ...] = (), echo_logprobs: tuple = (), echo_chars: int = 0
    ) -> dict[str, Any]:
        """`echo_ids`, `echo_logprobs`: the prompt's tokens and logprobs, echoed before the
        chunk's (vLLM lists them as one run); `echo_chars`: the echoed text's length."""
        formatted = self._format.completion(
            [*echo_ids, *chunk.token_ids],
            [*(vllm_prompt_logprobs(echo_logprobs) if echo_logprobs else [None] * len(echo_ids)), *_as_vllm(chunk)],
            self._top,
            self._tokenizer,
            initial_text_offset=self._text_offset,
        )
        self._text_offset += echo_chars + len(chunk.text)
        return formatted.model_dump()

    def chat(self, chunk: TokenChunk) -> dict[str, Any]:
        return self._format.chat(chunk.token_ids, _as_vllm(chunk), self._tokenizer, self._top).model_dump()

    def responses(self, chunk: TokenChunk) -> list[Any]:
        """The Responses API's: openai's Logprob objects, `top` alternatives each."""
        return self._format.responses(chunk.token_ids, _as_vllm(chunk), self._tokenizer, self._top)
