"""OpenAI response bodies from a request's events: whole answers, server-sent event streams,
usage, echo and logprobs, one choice or n.

The bodies are vLLM's protocol models, built once per stream as templates that each engine step
fills in (a pydantic model per token cost the HTTP stream ~12% of its token rate against gRPC:
bench.http_vs_grpc). An event is `(choice index, TokenChunk | GenerationResult)`; a choice's
result ends it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

from messages.requests import SamplingConfig
from messages.results import GenerationResult, TokenChunk
from router.chat_parsing import ChatParsing
from router.openai_errors import HTTPError
from router.openai_logprobs import LogprobsFormatter, vllm_prompt_logprobs

Event = tuple[int, "TokenChunk | GenerationResult"]


def sse(payload: Any) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def timings(result: GenerationResult) -> dict[str, Any]:
    t = result.timings
    return {
        **{k: v for k, v in asdict(t).items() if k not in ("inter_token", "transfer_bytes")},
        "inter_token_p50_s": t.inter_token.p50,
        "inter_token_p99_s": t.inter_token.p99,
        "attention_kv_bytes": t.transfer_bytes.attention_kv,
        "deltanet_state_bytes": t.transfer_bytes.deltanet_state,
        "prefill_worker": result.prefill_worker,
        "decode_worker": result.decode_worker,
        "cached_tokens": result.cached_tokens,
    }


def extensions(results: list[GenerationResult]) -> dict[str, Any]:
    """pdserve's fields beside OpenAI's in a whole answer: the first choice's timings, and
    with n > 1 every choice's."""
    extra = {"pdserve_timings": timings(results[0])}
    if len(results) > 1:
        extra["pdserve_choice_timings"] = [timings(r) for r in results]
    return extra


def usage(results: list[GenerationResult]) -> Any:
    """One request's usage: its prompt once, every choice's output (as vLLM counts n > 1)."""
    from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo, UsageInfo

    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=results[0].cached_tokens),
    )


async def collect(events: AsyncIterator[Event], n: int) -> tuple[list[TokenChunk], list[GenerationResult]]:
    """Each choice's whole output as one chunk, and its result."""
    chunks: list[list[TokenChunk]] = [[] for _ in range(n)]
    results: list[GenerationResult | None] = [None] * n
    async for index, event in events:
        if isinstance(event, GenerationResult):
            results[index] = event
        else:
            chunks[index].append(event)
    assert all(r is not None for r in results)
    return [TokenChunk.joined(c) if c else TokenChunk((), "") for c in chunks], results  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Echo:
    """What each choice's output starts with: the prompt's text (completions) or the last
    message's (chat), as vLLM echoes it; `only`: nothing else (completions' max_tokens 0)."""

    text: str
    token_ids: tuple[int, ...] = ()
    only: bool = False


@dataclass(slots=True)
class _Choice:
    """What one choice of a response has sent so far."""

    logprobs: LogprobsFormatter | None
    echoed: bool = False
    role_sent: bool = False
    completion_tokens: int = 0


class ResponseShape:
    """How one endpoint shapes one request's answer."""

    prefix = "cmpl"

    def __init__(self, model_name: str, body: Any, tokenizer: Any, n: int, echo: Echo | None) -> None:
        self.model_name = model_name
        # vLLM's response id: the client's request_id where it set one
        self.id = f"{self.prefix}-{body.request_id if 'request_id' in body.model_fields_set else uuid.uuid4().hex}"
        self.created = int(time.time())
        self._template: dict[str, Any] | None = None
        top = self.logprobs(body)
        as_ids = getattr(body, "return_tokens_as_token_ids", False)  # the Responses API has no such field
        self._choices = [_Choice(None if top is None else LogprobsFormatter(tokenizer, top, as_ids)) for _ in range(n)]
        self.n = n
        self.sampling: SamplingConfig | None = None  # the request's, once the front made it
        self._echo = echo
        # The prompt's logprobs, from the first chunk that has them (choice 0's first).
        self.prompt_logprobs: tuple = ()

    @property
    def echoes_only(self) -> bool:
        return self._echo is not None and self._echo.only

    # --- what the body asks, in this endpoint's names ----------------------------------------

    def max_tokens(self, body: Any) -> int | None:
        return body.max_tokens

    def logprobs(self, body: Any) -> int | None:
        return body.logprobs

    def prompt_logprobs_asked(self, body: Any) -> int | None:
        """vLLM's rule: prompt_logprobs, or with echo, as many as logprobs."""
        return body.prompt_logprobs if body.prompt_logprobs is not None or not body.echo else self.logprobs(body)

    def param(self, field_name: str, body: Any) -> str:  # noqa: ARG002
        """The request field a SamplingConfig/GenerateRequest field came from."""
        return "prompt" if field_name == "prompt_token_ids" else field_name

    # --- a stream ---------------------------------------------------------------------------

    def chunk(self, index: int, event: TokenChunk | None, finish: str | None) -> dict[str, Any]:
        """One stream chunk of choice `index`: `event`'s tokens, or none (finish only)."""
        if self._template is None:
            self._template = self.empty_chunk()
        chunk = dict(self._template)
        choice = dict(chunk["choices"][0])
        choice["index"] = index
        state = self._choices[index]
        if event is not None and event.prompt_logprobs:
            self.prompt_logprobs = event.prompt_logprobs
        self.fill(choice, state, event)
        choice["finish_reason"] = finish
        chunk["choices"] = [choice]
        return chunk

    def template(self) -> None:
        """Builds the chunk template now (while prefill runs, off the first token's path)."""
        if self._template is None:
            self._template = self.empty_chunk()

    async def stream(
        self, first: Event, events: AsyncIterator[Event], include_usage: bool, continuous_prompt_tokens: int | None
    ) -> AsyncIterator[bytes]:
        """`continuous_prompt_tokens`: put the usage so far in every chunk (None: don't).
        `events` raising the front's HTTPError mid-stream: the status line is sent, so the
        error goes out as one event."""
        results: list[GenerationResult] = []
        try:
            item: Event | None = first
            while item is not None:
                index, event = item
                if isinstance(event, GenerationResult):
                    results.append(event)
                    final = self.chunk(index, None, self.finish(index, event.finish_reason))
                    final["pdserve_timings"] = timings(event)
                    if continuous_prompt_tokens is not None:
                        final["usage"] = usage([event]).model_dump()
                    yield sse(final)
                else:
                    chunk = self.chunk(index, event, None)
                    if continuous_prompt_tokens is not None:
                        state = self._choices[index]
                        state.completion_tokens += len(event.token_ids)
                        chunk["usage"] = {
                            "prompt_tokens": continuous_prompt_tokens,
                            "completion_tokens": state.completion_tokens,
                            "total_tokens": continuous_prompt_tokens + state.completion_tokens,
                        }
                    yield sse(chunk)
                item = await anext(events, None)
            if include_usage:
                yield sse({**self.chunk(0, None, None), "choices": [], "usage": usage(results).model_dump()})
        except HTTPError as err:
            yield sse(err.body())
        finally:  # the client left, or the stream ended: abort and free the slot now, not at GC
            await events.aclose()
        yield sse("[DONE]")

    # --- per endpoint -----------------------------------------------------------------------

    def finish(self, index: int, reason: str) -> str:  # noqa: ARG002
        """The finish reason a choice reports."""
        return reason

    def empty_chunk(self) -> dict[str, Any]:
        raise NotImplementedError

    def fill(self, choice: dict[str, Any], state: _Choice, event: TokenChunk | None) -> None:
        raise NotImplementedError

    def whole(self, outputs: list[TokenChunk], results: list[GenerationResult]) -> dict[str, Any]:
        raise NotImplementedError

    def _echoed(self, state: _Choice, event: TokenChunk) -> tuple[str, tuple[int, ...], tuple]:
        """The text, token ids and prompt logprob positions this choice's chunk starts with:
        the echo, once."""
        if self._echo is None or state.echoed:
            return "", (), ()
        state.echoed = True
        return self._echo.text, self._echo.token_ids, self.prompt_logprobs


class CompletionShape(ResponseShape):
    prefix = "cmpl"

    def empty_chunk(self) -> dict[str, Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

        choices = [CompletionResponseStreamChoice(index=0, text="")]
        return CompletionStreamResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices
        ).model_dump()

    def fill(self, choice: dict[str, Any], state: _Choice, event: TokenChunk | None) -> None:
        if event is None:
            choice["text"] = ""
            return
        echo_text, echo_ids, echo_logprobs = self._echoed(state, event)
        if self._echo is not None and self._echo.only:  # the prompt alone, never the token run for it
            event = TokenChunk((), "")
        choice["text"] = echo_text + event.text
        if state.logprobs is not None:
            choice["logprobs"] = state.logprobs.completion(event, echo_ids, echo_logprobs, len(echo_text))

    def whole(self, outputs: list[TokenChunk], results: list[GenerationResult]) -> dict[str, Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

        if outputs[0].prompt_logprobs:
            self.prompt_logprobs = outputs[0].prompt_logprobs
        prompt_logprobs = vllm_prompt_logprobs(self.prompt_logprobs) if self.prompt_logprobs else None
        choices = []
        for index, (output, result) in enumerate(zip(outputs, results)):
            choice: dict[str, Any] = {"logprobs": None}
            self.fill(choice, self._choices[index], output)
            choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=choice["text"],
                    logprobs=choice["logprobs"],
                    finish_reason=result.finish_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
        response = CompletionResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage(results)
        )
        return {**response.model_dump(), **extensions(results)}


class ChatShape(ResponseShape):
    prefix = "chatcmpl"

    def __init__(
        self, model_name: str, body: Any, tokenizer: Any, n: int, echo: Echo | None, parsing: ChatParsing
    ) -> None:
        super().__init__(model_name, body, tokenizer, n, echo)
        self.role = chat_role(body)
        self._parsing = parsing

    def finish(self, index: int, reason: str) -> str:
        return self._parsing.finish_reason(index, reason)

    def max_tokens(self, body: Any) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else _deprecated_max_tokens(body)

    def logprobs(self, body: Any) -> int | None:
        return body.top_logprobs or 0 if body.logprobs else None

    def prompt_logprobs_asked(self, body: Any) -> int | None:
        """vLLM's rule: prompt_logprobs, or with echo, as many as top_logprobs."""
        return body.prompt_logprobs if body.prompt_logprobs is not None or not body.echo else body.top_logprobs

    def param(self, field_name: str, body: Any) -> str:
        if field_name == "max_tokens" and body.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs", "prompt": "messages", "prompt_token_ids": "messages"}.get(
            field_name, field_name
        )

    def empty_chunk(self) -> dict[str, Any]:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        choices = [ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=""))]
        return ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model_name, choices=choices
        ).model_dump()

    def fill(self, choice: dict[str, Any], state: _Choice, event: TokenChunk | None) -> None:
        # Only the fields a delta sets, as vLLM sends them (exclude_unset); the role in the
        # first delta only, as OpenAI does.
        if event is None:
            choice["delta"] = {}
            return
        echo_text, _, _ = self._echoed(state, event)
        delta = self._parsing.delta(choice["index"], event) or {}
        if echo_text:
            delta["content"] = echo_text + delta.get("content", "")
        choice["delta"] = delta
        if not state.role_sent:
            choice["delta"] = {"role": self.role, **choice["delta"]}
            state.role_sent = True
        if state.logprobs is not None:
            choice["logprobs"] = state.logprobs.chat(event)

    def whole(self, outputs: list[TokenChunk], results: list[GenerationResult]) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponse,
            ChatCompletionResponseChoice,
        )

        if outputs[0].prompt_logprobs:
            self.prompt_logprobs = outputs[0].prompt_logprobs
        choices = []
        for index, (output, result) in enumerate(zip(outputs, results)):
            state = self._choices[index]
            echo_text, _, _ = self._echoed(state, output)
            logprobs = state.logprobs.chat(output) if state.logprobs is not None else None
            message, called = self._parsing.message(index, output, self.role, echo_text)
            finish = self._parsing.finish_reason(index, result.finish_reason, called)
            choices.append(
                ChatCompletionResponseChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish)
            )
        response = ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=usage(results),
            prompt_logprobs=vllm_prompt_logprobs(self.prompt_logprobs) if self.prompt_logprobs else None,
        )
        return {**response.model_dump(), **extensions(results)}


def chat_role(body: Any) -> str:
    """Who answers, as vLLM has it: the assistant, or without a generation prompt the last
    message's author, going on."""
    return "assistant" if body.add_generation_prompt else (body.messages[-1].get("role") or "assistant")


def _deprecated_max_tokens(body: Any) -> int | None:
    """Chat's `max_tokens`, which OpenAI deprecated for max_completion_tokens but clients send."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return body.max_tokens
