"""OpenAI's Responses API (`POST /v1/responses`), text in and text out, on the chat path.

The body is vLLM's ResponsesRequest; its instructions and input become chat messages as vLLM
makes them (`construct_input_messages`), rendered by the model's chat template, and from there
the request runs as any chat request does, through prefill and decode. The answer and its
stream events are vLLM's too: its output items (`build_response_output_items`, reasoning split
off by the configured reasoning parser), its streaming state machine
(`SimpleStreamingEventProcessor`: output_item / content_part / output_text events with sequence
numbers), its ResponsesResponse. pdserve keeps no responses: `store`, `previous_response_id` and
`background` are refused by name (router/openai_fields.py), as are tools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

from messages.errors import InvalidRequestError
from messages.results import GenerationResult, TokenChunk
from router.openai_errors import HTTPError
from router.openai_responses import Event, ResponseShape, extensions

if TYPE_CHECKING:
    from vllm.parser import Parser

# The one `include` item that asks for something pdserve returns.
OUTPUT_LOGPROBS = "message.output_text.logprobs"


def as_chat_request(body: Any) -> Any:
    """The request's messages (instructions, then the input) as a chat request, for the chat
    template; refuses what the template cannot take."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    if body.store and "store" in body.model_fields_set:
        raise InvalidRequestError("store", "pdserve keeps no responses: send store false, or leave it out")
    other = sorted(set(body.include or ()) - {OUTPUT_LOGPROBS})
    if other:
        raise InvalidRequestError("include", f"{other} are not returned: only {OUTPUT_LOGPROBS!r} is")
    try:
        messages = construct_input_messages(request_instructions=body.instructions, request_input=body.input)
    except (ValueError, TypeError, KeyError) as err:
        raise InvalidRequestError("input", f"cannot be made into messages: {err}") from None
    # Not validated as chat: its input parts ("input_text") are not chat's, and the chat
    # template's content parser (router/chat_prompt.py) takes them as text, as vLLM's does.
    return ChatCompletionRequest.model_construct(messages=messages, chat_template_kwargs=body.chat_template_kwargs)


class ResponsesShape(ResponseShape):
    """A Responses API answer: one output message (and a reasoning item where the reasoning
    parser finds one), whole or as vLLM's stream of typed events."""

    prefix = "resp"

    def __init__(self, model_name: str, body: Any, tokenizer: Any, parser_class: type[Parser] | None) -> None:
        super().__init__(model_name, body, tokenizer, 1, None)
        self.id = body.request_id  # vLLM's: resp_<random> unless the client named it
        self._body = body
        self._tokenizer = tokenizer
        self._parser = None
        if parser_class is not None:
            self._parser = parser_class(tokenizer, [], chat_template_kwargs=body.chat_template_kwargs)
        self._prompt: list[int] = []

    def set_prompt(self, prompt: tuple[int, ...]) -> None:
        self._prompt = list(prompt)
        if self._parser is not None:
            self._parser.set_prompt_token_ids(self._prompt)

    def max_tokens(self, body: Any) -> int | None:
        return body.max_output_tokens

    def logprobs(self, body: Any) -> int | None:
        return body.top_logprobs if body.is_include_output_logprobs() else None

    def prompt_logprobs_asked(self, body: Any) -> int | None:  # noqa: ARG002
        return None

    def param(self, field_name: str, body: Any) -> str:  # noqa: ARG002
        return {"max_tokens": "max_output_tokens", "prompt": "input", "prompt_token_ids": "input",
                "logprobs": "top_logprobs"}.get(field_name, field_name)  # fmt: skip

    def template(self) -> None:
        return None

    # --- the answer ---------------------------------------------------------------------------

    def _response(self, output: list[Any], status: str, result: GenerationResult | None, reasoning_tokens: int) -> Any:
        from vllm.entrypoints.openai.responses.protocol import (
            InputTokensDetails,
            OutputTokensDetails,
            ResponsesResponse,
            ResponseUsage,
        )

        from vllm_engine.sampling import sampling_params

        usage = None
        if result is not None:
            usage = ResponseUsage(
                input_tokens=result.prompt_tokens,
                output_tokens=result.completion_tokens,
                total_tokens=result.prompt_tokens + result.completion_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens, cache_write_tokens=0),
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            )
        assert self.sampling is not None, "the front sets the request's sampling first"
        return ResponsesResponse.from_request(
            self._body,
            sampling_params(self.sampling),
            model_name=self.model_name,
            created_time=self.created,
            output=output,
            status=status,
            usage=usage,
        )

    def _reasoning_tokens(self, output: TokenChunk) -> int:
        return self._parser.count_reasoning_tokens(output.token_ids) if self._parser is not None else 0

    def whole(self, outputs: list[TokenChunk], results: list[GenerationResult]) -> dict[str, Any]:
        from vllm.entrypoints.openai.responses.utils import build_response_output_items

        (output,), (result,) = outputs, results
        state = self._choices[0]
        logprobs = state.logprobs.responses(output) if state.logprobs is not None else None
        reasoning, content = None, output.text
        if self._parser is not None:
            reasoning, content, _ = self._parser.parse(
                output.text, self._body, enable_auto_tools=False, model_output_token_ids=output.token_ids
            )
            if not self._body.include_reasoning:
                reasoning = logprobs = None  # as vLLM: their tokens would show the reasoning
        items = build_response_output_items(reasoning=reasoning, content=content, tool_calls=[], logprobs=logprobs)
        status = "incomplete" if result.finish_reason == "length" else "completed"
        response = self._response(items, status, result, self._reasoning_tokens(output))
        return {**response.model_dump(mode="json", by_alias=True), **extensions(results)}

    async def stream(
        self, first: Event, events: AsyncIterator[Event], include_usage: bool, continuous_prompt_tokens: int | None
    ) -> AsyncIterator[bytes]:
        """vLLM's event sequence: response.created, response.in_progress, the output items'
        events as the tokens come, response.completed (whose response holds the usage)."""
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.responses.protocol import ResponseCompletedEvent, ResponseCreatedEvent
        from vllm.entrypoints.openai.responses.protocol import ResponseInProgressEvent
        from vllm.entrypoints.openai.responses.streaming_events import (
            SimpleStreamingEventProcessor,
            _StateType,
            split_delta,
        )

        sequence = 0

        def sse(event: Any) -> bytes:
            nonlocal sequence
            event.sequence_number = sequence
            sequence += 1
            return f"event: {event.type}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n".encode()

        started = self._response([], "in_progress", None, 0).model_dump(mode="json", by_alias=True)
        processor = SimpleStreamingEventProcessor(tools=self._body.tools)
        state = self._choices[0]
        hide_logprobs = self._parser is not None and not self._body.include_reasoning
        chunks: list[TokenChunk] = []
        result: GenerationResult | None = None
        try:
            yield sse(ResponseCreatedEvent(type="response.created", sequence_number=-1, response=started))
            yield sse(ResponseInProgressEvent(type="response.in_progress", sequence_number=-1, response=started))
            item: Event | None = first
            while item is not None:
                _, event = item
                item = await anext(events, None)
                if isinstance(event, GenerationResult):
                    result = event
                    continue
                chunks.append(event)
                if self._parser is None:
                    delta = DeltaMessage(content=event.text)
                else:
                    delta = self._parser.parse_delta(
                        event.text, list(event.token_ids), self._body, self._prompt,
                        finished=event.finish_reason is not None,
                    )  # fmt: skip
                    if delta is not None and not self._body.include_reasoning:
                        delta.reasoning = None
                if delta is None:
                    continue
                logprobs = [] if state.logprobs is None or hide_logprobs else state.logprobs.responses(event)
                for part in split_delta(delta):
                    target, call = processor.resolve_target_state(part)
                    if target == _StateType.NONE:
                        continue
                    if processor.needs_transition(target, call):
                        for done in processor.close_current():
                            yield sse(done)
                        for opened in processor.open(target, call):
                            yield sse(opened)
                    for step in processor.emit_delta(part, None, lambda _: logprobs):
                        yield sse(step)
            for done in processor.close_current():
                yield sse(done)
            assert result is not None
            output = TokenChunk.joined(chunks) if chunks else TokenChunk((), "")
            status = "incomplete" if result.finish_reason == "length" else "completed"
            final = self._response(processor.output_items, status, result, self._reasoning_tokens(output))
            yield sse(ResponseCompletedEvent(type="response.completed", sequence_number=-1, response=final))
        except HTTPError as err:  # mid-stream: the status line is sent, so the error is an event
            error = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
            yield f"event: error\ndata: {_json({**error, 'sequence_number': sequence})}\n\n".encode()
        finally:  # the client left, or the stream ended: abort and free the slot now, not at GC
            await events.aclose()


def _json(payload: dict[str, Any]) -> str:
    import json

    return json.dumps(payload, separators=(",", ":"))
