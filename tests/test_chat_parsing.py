"""Tool calls and reasoning in chat answers, through vLLM's own parsers (hermes tool calls,
qwen3 reasoning) on fixed model outputs: whole and streamed, every tool_choice, and the
refusals vLLM gives. No engine: the front runs over a scripted orchestrator that streams the
given text (tests/test_openai_http.py runs tools through real engines)."""

from __future__ import annotations

import json

import pytest
from test_openai_edges import CHAT, LIMITS, MESSAGES, FakeOrchestrator, _events, _post, assert_openai_error

from messages.membership import AdmissionLimits
from messages.results import GenerationResult, TokenChunk
from messages.timings import LatencySummary, PhaseTimings
from messages.transfer import TransferBytes
from router.admission import AdmissionController
from router.chat_parsing import ChatParsers
from router.openai_http import OpenAIFront

MODEL = "edge-model"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants the weather.\n</think>\n\n"
ALL_PARSERS = ChatParsers(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3")


class ScriptedOrchestrator(FakeOrchestrator):
    """Streams `text`, three tokens a chunk, after the real checks."""

    text = ""

    async def generate(self, request):
        from vllm_engine.sampling import sampling_params

        request.validate(self.limits)
        sampling_params(request.sampling)
        self.requests.append(request)
        ids = self.tokenizer.encode(self.text)
        pieces = [ids[i : i + 3] for i in range(0, len(ids), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield TokenChunk(tuple(piece), self.tokenizer.decode(piece), "stop" if last else None)
        timings = PhaseTimings(0, 0, 0, 0, LatencySummary.of([]), 0, 0, TransferBytes(0, 0))
        yield GenerationResult("stop", len(request.prompt_token_ids), len(ids), timings, "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _front(tokenizer, parsers: ChatParsers, text: str) -> OpenAIFront:
    orchestrator = ScriptedOrchestrator()
    orchestrator.tokenizer, orchestrator.text = tokenizer, text
    admission = AdmissionController(lambda: AdmissionLimits(8, 8))
    return OpenAIFront(orchestrator, tokenizer, MODEL, admission, 32 * LIMITS.max_model_len, parsers=parsers)


def _ask(front, **fields) -> dict:
    response = _post(front, CHAT, {"messages": MESSAGES, "max_tokens": 64, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_auto_tool_choice_parses_the_call_and_the_reasoning(tokenizer):
    answer = _ask(_front(tokenizer, ALL_PARSERS, THOUGHT + CALL), tools=[WEATHER, CLOCK])
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["reasoning"] == "\nThe user wants the weather.\n"
    assert not choice["message"]["content"]


def test_streamed_tool_call_deltas_take_openais_shape(tokenizer):
    front = _front(tokenizer, ALL_PARSERS, THOUGHT + CALL)
    chunks = _events(_post(front, CHAT, {"messages": MESSAGES, "tools": [WEATHER], "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nThe user wants the weather.\n"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    first = calls[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"]
    assert first["function"]["name"] == "get_weather"
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_no_tools_leave_the_text_alone(tokenizer):
    front = _front(tokenizer, ALL_PARSERS, CALL)
    choice = _ask(front, tools=[WEATHER], tool_choice="none")["choices"][0]
    assert choice["message"]["content"] == CALL and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    front = _front(tokenizer, ALL_PARSERS, TWO_CALLS)
    both = _ask(front, tools=[WEATHER, CLOCK])["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in both] == ["get_weather", "get_time"]
    one = _ask(front, tools=[WEATHER, CLOCK], parallel_tool_calls=False)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in one] == ["get_weather"]


def test_include_reasoning_false_leaves_the_reasoning_out(tokenizer):
    front = _front(tokenizer, ChatParsers(reasoning_parser="qwen3"), THOUGHT + "Sunny.")
    message = _ask(front, include_reasoning=False)["choices"][0]["message"]
    assert message["content"].strip() == "Sunny." and message.get("reasoning") is None


@pytest.mark.parametrize(
    "tool_choice, finish",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_required_and_named_tool_choice_are_structured_outputs(tokenizer, tool_choice, finish):
    """As vLLM makes them: a constraint (the parser's structural tag) that decode samples
    whole (SamplingConfig.decoded_whole), the call parsed from what it produced."""
    front = _front(tokenizer, ChatParsers(tool_call_parser="hermes"), CALL)
    choice = _ask(front, tools=[WEATHER, CLOCK], tool_choice=tool_choice)["choices"][0]
    sampling = front._orchestrator.requests[-1].sampling
    assert sampling.structured is not None and sampling.structured.kind in ("structural_tag", "json")
    assert sampling.decoded_whole and not sampling.skip_special_tokens  # hermes keeps its markers
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["finish_reason"] == finish


@pytest.mark.parametrize(
    "parsers, fields, says",
    [
        (ChatParsers(), {"tool_choice": "auto"}, "--enable-auto-tool-choice"),
        (ChatParsers(tool_call_parser="hermes"), {"tool_choice": "auto"}, "--enable-auto-tool-choice"),
        (ChatParsers(), {"tool_choice": "required"}, "--tool-call-parser"),
        (
            ChatParsers(),
            {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "--tool-call-parser",
        ),
        (ALL_PARSERS, {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not match"),
    ],
)
def test_a_tool_choice_the_server_cannot_honour_is_400(tokenizer, parsers, fields, says):
    response = _post(_front(tokenizer, parsers, CALL), CHAT, {"messages": MESSAGES, "tools": [WEATHER], **fields})
    error = assert_openai_error(response, 400)
    assert says in error["message"] and error["param"].startswith("tool_choice"), error


def test_an_unknown_parser_fails_the_front_at_start(tokenizer):
    with pytest.raises(ValueError, match="tool-call-parser"):
        _front(tokenizer, ChatParsers(tool_call_parser="no-such-parser"), "")


def test_tools_and_template_arguments_reach_the_chat_template(tokenizer):
    """The template sees the tools and chat_template_kwargs (reasoning_effort as
    enable_thinking, as vLLM passes it); arguments it does not read are dropped."""
    shown = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    shown.chat_template = (
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
        "{% if enable_thinking is defined %}(thinking {{ enable_thinking }}){% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    front = _front(shown, ALL_PARSERS, "Sunny.")
    _ask(front, tools=[WEATHER, CLOCK], reasoning_effort="none", chat_template_kwargs={"unread": 1})
    prompt = shown.decode(front._orchestrator.requests[-1].prompt_token_ids)
    assert prompt == f"[get_weather][get_time](thinking False){MESSAGES[0]['content']}"
