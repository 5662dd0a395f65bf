"""Tool calls and reasoning in chat answers, by vLLM's own parsers (`vllm.parser`).

The flags are vLLM's (`--tool-call-parser`, `--enable-auto-tool-choice`, `--reasoning-parser`),
and so is every step: the request adjustment (tool_choice "required" or a named function
becomes a structured output, which decode samples whole, as every structured output:
kv_transfer/producer.py), and the extraction of reasoning and tool calls from the text the
engines return, whole or delta by delta. The router runs them over the output of both legs,
so an answer's tool calls are what a colocated vLLM server parses from the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from configuration.fields import knob
from messages.errors import InvalidRequestError
from messages.results import TokenChunk

if TYPE_CHECKING:
    from vllm.parser import Parser


@dataclass(frozen=True, slots=True)
class ChatParsers:
    tool_call_parser: str | None = knob(
        None, help="vLLM's tool-call parser for the model's format (hermes, qwen3_coder, ...): tool_choice needs it"
    )
    enable_auto_tool_choice: bool = knob(
        False, help="let the model decide when to call tools (tool_choice auto); needs --tool-call-parser"
    )
    reasoning_parser: str | None = knob(
        None, help="vLLM's reasoning parser (qwen3, deepseek_r1, ...): the model's reasoning goes to `reasoning`"
    )

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs a parser: pass --tool-call-parser (e.g. hermes)")

    def parser_class(self, tokenizer: Any, tools: bool = True) -> type[Parser] | None:
        """vLLM's parser for these flags, checked against the model's tokenizer; None when
        no parser is asked for. Unlike vLLM 0.32, which loads a tool parser only with auto
        tool choice on, --tool-call-parser alone serves required and named tool choice:
        they are structured outputs, which any model can follow. `tools` False: the
        reasoning parser alone (the Responses API takes no tools)."""
        from vllm.parser import ParserManager

        try:
            return ParserManager.get_parser(
                tool_parser_name=self.tool_call_parser if tools else None,
                reasoning_parser_name=self.reasoning_parser,
                enable_auto_tools=tools and self.tool_call_parser is not None,
                tokenizer=tokenizer,
            )
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"--tool-call-parser / --reasoning-parser: {err}") from None


class ChatParsing:
    """One chat request's parsing: one vLLM Parser per choice (they keep stream state)."""

    def __init__(self, parser_class: type[Parser] | None, body: Any, tokenizer: Any, prompt: list[int]) -> None:
        self._class = parser_class
        self._body = body
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._parsers: dict[int, Parser] = {}
        self._tools_streamed: set[int] = set()
        named = body.tool_choice is not None and not isinstance(body.tool_choice, str)
        self._named = named
        self._forced = named or body.tool_choice == "required"

    @staticmethod
    def check(body: Any, parser_class: type[Parser] | None, parsers: ChatParsers) -> None:
        """vLLM's refusals of a tool_choice the server cannot honour (400 naming it)."""
        if body.tool_choice in (None, "none"):
            return
        if body.tool_choice == "auto":  # vLLM's default where tools are given
            if not parsers.enable_auto_tool_choice:
                raise InvalidRequestError(
                    "tool_choice",
                    '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser',
                )
        elif parser_class is None or parser_class.tool_parser_cls is None:
            raise InvalidRequestError(
                "tool_choice", "required or a named function needs the server started with --tool-call-parser"
            )

    @staticmethod
    def adjusted(body: Any, parser_class: type[Parser] | None, tokenizer: Any) -> Any:
        """The request as vLLM adjusts it for its parsers: a forced tool call becomes a
        structured output (a JSON schema of the tools, or the parser's structural tag)."""
        if parser_class is None:
            return body
        if body.tool_choice == "none" and parser_class.reasoning_parser_cls is None:
            return body
        try:
            return parser_class(tokenizer, body.tools, chat_template_kwargs=body.chat_template_kwargs).adjust_request(
                body
            )
        except ValueError as err:  # a named tool that is not among the tools
            raise InvalidRequestError("tool_choice", str(err)) from None

    def _parser(self, index: int) -> Parser | None:
        if self._class is None:
            return None
        if index not in self._parsers:
            kwargs = self._body.chat_template_kwargs
            parser = self._class(self._tokenizer, self._body.tools, chat_template_kwargs=kwargs)
            parser.set_prompt_token_ids(self._prompt)
            self._parsers[index] = parser
        return self._parsers[index]

    def message(self, index: int, output: TokenChunk, role: str, echoed: str) -> tuple[Any, bool]:
        """A whole choice's message as vLLM's chat serving builds it (`echoed`: what chat's
        echo puts before its content), and whether it called tools (finish reason "tool_calls")."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage
        from vllm.renderers.chat_utils import make_tool_call_id

        parser = self._parser(index)
        if parser is None:
            return ChatMessage(role=role, content=echoed + output.text), False
        # Auto tool choice was refused (check) unless the server allows it.
        reasoning, content, calls = parser.parse(
            output.text, self._body, enable_auto_tools=True, model_output_token_ids=output.token_ids
        )
        if not self._body.include_reasoning:
            reasoning = None
        auto = self._body.tools and self._body.tool_choice in ("auto", None)
        calls = list(calls or []) if self._forced or auto else []
        if self._body.parallel_tool_calls is False:
            calls = calls[:1]
        tool_calls = [ToolCall(id=call.id or make_tool_call_id(), function=call) for call in calls]
        if self._forced:
            content = content or ""
        if echoed:
            content = echoed + (content or "")
        message = ChatMessage(role=role, reasoning=reasoning, content=content, tool_calls=tool_calls)
        return message, bool(tool_calls) and not self._named

    def delta(self, index: int, chunk: TokenChunk) -> dict[str, Any] | None:
        """One streamed chunk's delta (reasoning, content or tool-call deltas in OpenAI's
        shape), as vLLM's parser gives it; None where it holds the text back."""
        parser = self._parser(index)
        if parser is None:
            return {"content": chunk.text}
        message = parser.parse_delta(
            chunk.text, list(chunk.token_ids), self._body, self._prompt, finished=chunk.finish_reason is not None
        )
        if message is None:
            return None
        if message.tool_calls:
            self._tools_streamed.add(index)
            if self._body.parallel_tool_calls is False:
                message.tool_calls = [call for call in message.tool_calls if call.index == 0]
        if not self._body.include_reasoning:
            message.reasoning = None
        return message.model_dump(exclude_unset=True, exclude_none=True)

    def finish_reason(self, index: int, reason: str, called_tools: bool = False) -> str:
        """OpenAI's: "tool_calls" where auto or required tool choice called tools, "stop"
        for a named function."""
        if reason != "stop" or self._named:
            return reason
        streamed = index in self._tools_streamed
        return "tool_calls" if called_tools or streamed or self._body.tool_choice == "required" else reason
