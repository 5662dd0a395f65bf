"""The Responses API (`POST /v1/responses`) without engines: the answer and its event stream in
vLLM's shapes, instructions and input rendered as chat, logprobs, structured text, and what
pdserve refuses (it keeps no responses). tests/test_openai_http.py runs it through real engines
with the official client."""

from __future__ import annotations

import json

from test_openai_edges import LIMITS, _post, assert_openai_error, front, tokenizer  # noqa: F401

RESPONSES = "/v1/responses"


def _events(response) -> list[tuple[str, dict]]:
    """(event type, payload) of each server-sent event."""
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        payload = json.loads(lines["data"])
        assert lines["event"] == payload["type"]
        events.append((lines["event"], payload))
    return events


def test_a_response_holds_one_output_message_and_its_usage(front):  # noqa: F811
    answer = _post(front, RESPONSES, {"input": "Why split prefill from decode?", "max_output_tokens": 8}).json()
    assert answer["object"] == "response" and answer["id"].startswith("resp_")
    (message,) = answer["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"] == " w0 w1 w2"
    assert answer["status"] == "incomplete" and answer["incomplete_details"]["reason"] == "max_output_tokens"
    prompt = len(front._orchestrator.requests[-1].prompt_token_ids)
    usage = answer["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (prompt, 3, prompt + 3)
    assert answer["max_output_tokens"] == 8 and "pdserve_timings" in answer


def test_instructions_and_input_items_are_rendered_as_chat_messages(front, tokenizer):  # noqa: F811
    body = {
        "instructions": "Answer briefly.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "What moves?"}]}],
        "max_output_tokens": 4,
    }
    assert _post(front, RESPONSES, body).status_code == 200
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What moves?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert front._orchestrator.requests[-1].prompt_token_ids == tuple(tokenizer.encode(text))


def test_the_stream_is_vllms_event_sequence_numbered_from_zero(front):  # noqa: F811
    response = _post(front, RESPONSES, {"input": "Why?", "max_output_tokens": 3, "stream": True})
    events = _events(response)
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    assert "".join(p["delta"] for k, p in events if k == "response.output_text.delta") == " w0 w1 w2"
    completed = events[-1][1]["response"]
    assert completed["output"][0]["content"][0]["text"] == " w0 w1 w2" and completed["usage"]["output_tokens"] == 3


def test_output_logprobs_come_with_the_include_item(front):  # noqa: F811
    body = {"input": "Why?", "max_output_tokens": 3, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    text = _post(front, RESPONSES, body).json()["output"][0]["content"][0]
    assert len(text["logprobs"]) == 3 and all(len(lp["top_logprobs"]) == 2 for lp in text["logprobs"])
    assert front._orchestrator.requests[-1].sampling.logprobs == 2
    _post(front, RESPONSES, {"input": "Why?", "max_output_tokens": 3, "top_logprobs": 2})
    assert front._orchestrator.requests[-1].sampling.logprobs is None  # asked for nothing without include


def test_a_json_schema_text_format_is_a_structured_output(front):  # noqa: F811
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema}}
    assert _post(front, RESPONSES, {"input": "Is it?", "max_output_tokens": 4, "text": text}).status_code == 200
    structured = front._orchestrator.requests[-1].sampling.structured
    assert structured.kind == "json" and json.loads(structured.spec) == schema


def test_what_pdserve_does_not_keep_or_return_is_refused_by_name(front):  # noqa: F811
    for field, value in (("store", True), ("previous_response_id", "resp_1"), ("background", True)):
        error = assert_openai_error(_post(front, RESPONSES, {"input": "x y", field: value}), 400)
        assert error["param"] in (field, "store"), error
    error = assert_openai_error(
        _post(front, RESPONSES, {"input": "x y", "include": ["reasoning.encrypted_content"]}), 400
    )
    assert error["param"] == "include" and "reasoning.encrypted_content" in error["message"]
    assert _post(front, RESPONSES, {"input": "x y", "store": False, "max_output_tokens": 2}).status_code == 200
    assert assert_openai_error(_post(front, RESPONSES, {"input": []}), 400)["param"] == "input"
    too_long = {"input": "x y", "max_output_tokens": LIMITS.max_model_len}
    assert assert_openai_error(_post(front, RESPONSES, too_long), 400)["param"] == "input"
