"""The request-field table (router/openai_fields.py) against vLLM's request models, the gRPC
message and docs/api.md; refusals by name through the HTTP front (fake engines)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_openai_edges import CHAT, COMPLETIONS, MESSAGES, _post, assert_openai_error, front, tokenizer  # noqa: F401

from router import openai_fields
from router.openai_fields import GRPC_TABLE, RESPONSES_TABLE, TABLE, placements

ROOT = Path(__file__).resolve().parent.parent


def _models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return {
        openai_fields.COMPLETIONS: CompletionRequest,
        openai_fields.CHAT: ChatCompletionRequest,
        openai_fields.RESPONSES: ResponsesRequest,
    }


ENDPOINTS = (openai_fields.COMPLETIONS, openai_fields.CHAT, openai_fields.RESPONSES)
PATHS = {openai_fields.COMPLETIONS: COMPLETIONS, openai_fields.CHAT: CHAT, openai_fields.RESPONSES: "/v1/responses"}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_of_vllms_request_model_is_placed(endpoint):
    fields = set(_models()[endpoint].model_fields)
    placed = set(placements(endpoint))
    assert fields - placed == set(), f"vLLM's {endpoint} request has fields the table does not place"
    assert placed - fields == set(), f"the table places {endpoint} fields vLLM's model no longer has"


def test_every_field_of_the_grpc_request_is_placed():
    from proto.pdserve.v1 import generate_pb2 as pb

    request = pb.GenerateRequest.DESCRIPTOR
    names = {f.name for f in request.fields if f.name != "sampling"}
    names |= {f"sampling.{f.name}" for f in pb.SamplingParams.DESCRIPTOR.fields}
    assert names == {p.name for p in GRPC_TABLE}


def test_rows_are_unique_and_say_why():
    keys = [(p.name, e) for p in TABLE + RESPONSES_TABLE for e in p.endpoints]
    assert len(keys) == len(set(keys))
    assert all(len(p.why) > 10 for p in TABLE + RESPONSES_TABLE + GRPC_TABLE)


def test_docs_render_the_table():
    doc = (ROOT / "docs" / "api.md").read_text()
    assert openai_fields.rendered_section() in doc, "docs/api.md is stale: run `python -m router.openai_fields`"
    for p in TABLE + RESPONSES_TABLE + GRPC_TABLE:
        assert f"| `{p.name}` |" in doc


# A value that asks for something, per refused field (every refused row needs one: the test
# below fails for a row without).
ASKS_FOR_SOMETHING = {
    "echo": True,
    "suffix": "tail",
    "prompt_embeds": b"x",
    "truncate_prompt_tokens": 3,
    "truncation_side": "left",
    "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "media_io_kwargs": {"image": {"x": 1}},
    "mm_processor_kwargs": {"x": 1},
    "n": 2,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "watermarking": True,
    "logprob_token_ids": [5],
    "repetition_detection": {"max_pattern_size": 4, "min_count": 3},
    "thinking_token_budget": 10,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"choice": ["a", "b"]},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning_effort": "low",
    "include_reasoning": False,
    "prompt_logprobs": 1,
    "return_token_ids": True,
    "return_prompt_text": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "stream_interval": 4,
    "routed_experts_prompt_start": 2,
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "session_id": "s",
    "priority": 1,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
}
# The Responses API's own refused fields (and its tools' shape).
RESPONSES_ASKS = {
    "store": True,
    "background": True,
    "previous_response_id": "resp_earlier",
    "previous_input_messages": [{"role": "user", "content": "hi"}],
    "enable_response_messages": True,
    "prompt": {"id": "pmpt_1"},
    "reasoning": {"effort": "low"},
    "prompt_cache_key": "tenant-a",
    "service_tier": "flex",
    "truncation": "auto",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_tool_calls": 2,
}
# What other fields a refused one needs to be a valid request at all.
_COMPANIONS = {"logprob_token_ids": {"logprobs": 2}, "truncation_side": {"truncate_prompt_tokens": 3}}
# Fields vLLM's model sets from a refused one (so either may be named).
_IMPLIED = {"return_mm_kwargs": {"mm_payload"}, "tools": {"tool_choice"}}


def _base(endpoint: str) -> dict:
    if endpoint == openai_fields.RESPONSES:
        return {"input": "Prefill makes the state", "max_output_tokens": 2}
    return (
        {"prompt": "Prefill makes the state", "max_tokens": 2}
        if endpoint == openai_fields.COMPLETIONS
        else {"messages": MESSAGES, "max_tokens": 2}
    )


def _refused_cases():
    for endpoint in ENDPOINTS:
        for p in placements(endpoint).values():
            if not p.honoured:
                yield endpoint, p.name


@pytest.mark.parametrize("endpoint, name", list(_refused_cases()))
def test_a_refused_field_asking_for_something_is_400_naming_it(front, endpoint, name):  # noqa: F811
    asks = {**ASKS_FOR_SOMETHING, **RESPONSES_ASKS} if endpoint == openai_fields.RESPONSES else ASKS_FOR_SOMETHING
    assert name in asks, f"give refused field {name!r} a value that asks for something"
    value = asks[name]
    companions = _COMPANIONS.get(name, {})
    if endpoint == openai_fields.CHAT and name == "logprob_token_ids":
        companions = {"logprobs": True}
    body = {**_base(endpoint), **companions, name: value}
    if name == "prompt_embeds":
        body = {"prompt_embeds": "eA==", "max_tokens": 2}
    response = _post(front, PATHS[endpoint], body)
    error = assert_openai_error(response, 400)
    assert error["param"] in {name, *companions, *_IMPLIED.get(name, ())}, error  # a companion may be refused first


@pytest.mark.parametrize(
    "path, extra",
    [
        (COMPLETIONS, {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}),
        (COMPLETIONS, {"echo": False, "logit_bias": {}, "bad_words": [], "min_tokens": 0, "seed": None}),
        (COMPLETIONS, {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "stream_interval": 1}),
        (CHAT, {"tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"}}),
        (CHAT, {"logprobs": False, "top_logprobs": 0, "include_reasoning": True, "skip_special_tokens": True}),
        (CHAT, {"user": "someone", "request_id": "my-id-1"}),
    ],
)
def test_values_that_ask_for_nothing_are_accepted(front, path, extra):  # noqa: F811
    base = _base(openai_fields.COMPLETIONS if path == COMPLETIONS else openai_fields.CHAT)
    response = _post(front, path, {**base, **extra})
    assert response.status_code == 200, response.text


def test_a_field_no_model_has_is_refused_by_name(front):  # noqa: F811
    error = assert_openai_error(_post(front, COMPLETIONS, {**_base(openai_fields.COMPLETIONS), "temprature": 0.5}), 400)
    assert error["param"] == "temprature" and "unrecognized" in error["message"]


def test_request_id_names_the_response(front):  # noqa: F811
    body = {**_base(openai_fields.CHAT), "request_id": "trace-42"}
    assert _post(front, CHAT, body).json()["id"] == "chatcmpl-trace-42"


def test_text_content_parts_are_joined_as_vllm_does_and_others_refused(front, tokenizer):  # noqa: F811
    parts = [{"type": "text", "text": "Why split"}, {"type": "text", "text": "prefill from decode?"}]
    assert _post(front, CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}).status_code == 200
    joined = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Why split\nprefill from decode?"}], add_generation_prompt=True, tokenize=False
    )
    assert front._orchestrator.requests[-1].prompt_token_ids == tuple(
        tokenizer.encode(joined, add_special_tokens=False)
    )
    image = [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]
    error = assert_openai_error(_post(front, CHAT, {"messages": [{"role": "user", "content": image}]}), 400)
    assert error["param"] == "messages[0].content[0]" and "text only" in error["message"]


def test_template_arguments_reach_the_template(front, tokenizer):  # noqa: F811
    body = {"messages": MESSAGES, "max_tokens": 2, "add_generation_prompt": False}
    assert _post(front, CHAT, body).status_code == 200
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert front._orchestrator.requests[-1].prompt_token_ids == tuple(tokenizer.encode(text, add_special_tokens=False))
    both = {**body, "add_generation_prompt": True, "continue_final_message": True}
    assert_openai_error(_post(front, CHAT, both), 400)


def test_continuous_usage_stats_put_usage_in_every_chunk(front):  # noqa: F811
    from test_openai_edges import _events

    body = {**_base(openai_fields.COMPLETIONS), "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    chunks = _events(_post(front, COMPLETIONS, body))
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert counted == [1, 2, 3]
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
