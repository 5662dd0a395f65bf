"""The OpenAI HTTP front's edges without engines: error shapes, refusals of malformed bodies
(400 naming the field, never 500), media types, unknown routes, the chat stream's deltas,
and a property test of both endpoints' bodies. An in-process fake orchestrator validates
each request exactly as the real one does (messages/requests.py) and builds vLLM's own
SamplingParams from it, so vLLM's checks run too."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import pytest

from messages.requests import ModelLimits
from messages.results import GenerationResult, TokenChunk
from messages.timings import LatencySummary, PhaseTimings
from messages.transfer import TransferBytes
from messages.membership import AdmissionLimits
from router.admission import AdmissionController
from router.openai_http import OpenAIFront

MODEL = "edge-model"
LIMITS = ModelLimits(max_model_len=512, vocab_size=2048, min_prompt_tokens=2)
COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MESSAGES = [{"role": "user", "content": "Why split prefill from decode?"}]


class _Pool:
    has_live_member = True


class FakeOrchestrator:
    """Streams three tokens (with logprobs when asked) after the real checks."""

    limits = LIMITS
    decode = _Pool()

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def generate(self, request):
        from vllm_engine.sampling import sampling_params

        request.validate(self.limits)
        sampling_params(request.sampling)  # vLLM's own checks, as the engines run them
        self.requests.append(request)
        n = min(3, request.sampling.max_tokens)
        prompt_logprobs = ()
        if request.sampling.prompt_logprobs is not None:  # the prompt token first, then the best
            prompt_logprobs = (None,) + tuple(
                (
                    (t, -1.5, 4, None),
                    *((9 + k, -0.2 * (k + 1), k + 1, None) for k in range(request.sampling.prompt_logprobs)),
                )
                for t in request.prompt_token_ids[1:]
            )
        for i in range(n):
            top = ()
            if request.sampling.logprobs is not None:
                top = (tuple((7 + i + k, -0.1 * (k + 1)) for k in range(max(1, request.sampling.logprobs))),)
            yield TokenChunk(
                (7 + i,),
                f" w{i}",
                "length" if i == n - 1 else None,
                top,
                prompt_logprobs=prompt_logprobs if i == 0 else (),
            )
        timings = PhaseTimings(0, 0, 0, 0, LatencySummary.of([]), 0, 0, TransferBytes(0, 0))
        yield GenerationResult("length", len(request.prompt_token_ids), n, timings, "prefill-0", "decode-0")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture
def front(tokenizer):
    orchestrator = FakeOrchestrator()
    admission = AdmissionController(lambda: AdmissionLimits(8, 8))
    return OpenAIFront(orchestrator, tokenizer, MODEL, admission, max_prompt_bytes=32 * LIMITS.max_model_len)


def _post(front, path: str, body: Any, content_type: str = "application/json") -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=front.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
            return await client.post(path, content=raw, headers={"content-type": content_type})

    return asyncio.run(send())


def _get(front, path: str) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=front.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as client:
            return await client.get(path)

    return asyncio.run(send())


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] is None or isinstance(error["code"], str)
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": [[1, 2], [3, 4]]}, "prompt"),
        (COMPLETIONS, {"prompt": [[[1]]]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 99999]}, "prompt"),
        (COMPLETIONS, {"prompt": "a b c", "n": 17}, "n"),
        (COMPLETIONS, {"prompt": "a b c", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "a b c", "prompt_logprobs": 21}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "n": "two"}, "n"),
        (COMPLETIONS, {"prompt": "a b c", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "a b c", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "a b c", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"prompt": "a b c", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a b c", "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS, {"prompt": "a b c", "max_tokens": 10_000}, "prompt"),
        (COMPLETIONS, {"prompt": "a b c", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "logprobs": -1}, "logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "logprobs": "3"}, "logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "seed": 2**70}, "seed"),
        (COMPLETIONS, {"prompt": "a b c", "stop": [""]}, "stop"),
        (COMPLETIONS, {"prompt": "a b c", "stop_token_ids": [5000]}, "stop_token_ids"),
        (COMPLETIONS, {"prompt": "a b c", "model": 3}, "model"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": "hello"}, "messages"),
        (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (COMPLETIONS, {"prompt": "a b c", "min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"prompt": "a b c", "presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "a b c", "frequency_penalty": -2.5}, "frequency_penalty"),
        (COMPLETIONS, {"prompt": "a b c", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"prompt": "a b c", "logit_bias": {"x": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "a b c", "logit_bias": {"99999": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "a b c", "allowed_token_ids": []}, "allowed_token_ids"),
        (COMPLETIONS, {"prompt": "a b c", "allowed_token_ids": [5000]}, "allowed_token_ids"),
        (COMPLETIONS, {"prompt": "a b c", "bad_words": [""]}, "bad_words"),
        (COMPLETIONS, {"prompt": "a b c", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
        (COMPLETIONS, {"prompt": "a b c", "min_tokens": -1}, "min_tokens"),
        (CHAT, {"messages": MESSAGES, "min_tokens": 9, "max_completion_tokens": 3}, "min_tokens"),
        (CHAT, {"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
        (CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": MESSAGES, "n": -1}, "n"),
    ],
)
def test_malformed_body_is_400_naming_the_field(front, path, body, param):
    assert_openai_error(_post(front, path, body), 400, param)


@pytest.mark.parametrize(
    "raw",
    [
        '{"prompt": "a b c", "temperature": NaN}',
        '{"prompt": "a b c", "top_p": Infinity}',
        '{"prompt": "a',
        "[]",
        "null",
        "",
    ],
)
def test_body_that_is_not_a_request_object_is_400(front, raw):
    assert_openai_error(_post(front, COMPLETIONS, raw), 400)


def test_n_given_as_a_whole_float_is_one_choice(front):
    response = _post(front, COMPLETIONS, {"prompt": "a b c", "n": 1.0, "max_tokens": 2})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_body_not_sent_as_json_is_415(front, content_type):
    error = assert_openai_error(_post(front, COMPLETIONS, {"prompt": "a b c"}, content_type), 415)
    assert "application/json" in error["message"] and error["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_accepted(front):
    assert (
        _post(front, COMPLETIONS, {"prompt": "a b c", "max_tokens": 2}, "application/json; charset=utf-8").status_code
        == 200
    )


def test_unknown_route_and_method_answer_in_openai_shape(front):
    error = assert_openai_error(_post(front, "/v1/embeddings", {"input": "x"}), 404)
    assert "/v1/completions" in error["message"]  # says what is there
    assert_openai_error(_get(front, "/nope"), 404)
    assert_openai_error(_get(front, COMPLETIONS), 405)
    assert_openai_error(_post(front, "/v1/models", {}), 405)


def test_unknown_model_is_404_model_not_found(front):
    error = assert_openai_error(_post(front, COMPLETIONS, {"model": "gpt-4", "prompt": "a b c"}), 404, "model")
    assert error["code"] == "model_not_found" and MODEL in error["message"]


def test_chat_without_max_tokens_runs_to_the_context_end(front):
    response = _post(front, CHAT, {"messages": MESSAGES})
    assert response.status_code == 200
    request = front._orchestrator.requests[-1]
    assert request.sampling.max_tokens == LIMITS.max_model_len - len(request.prompt_token_ids)


def _events(response: httpx.Response) -> list[Any]:
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_stream_carries_the_role_in_the_first_delta_only(front):
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    chunks = [c for c in _events(_post(front, CHAT, body)) if c["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": " w0"}
    assert all("role" not in d for d in deltas[1:]), deltas
    assert "".join(d.get("content", "") for d in deltas) == " w0 w1 w2"


def test_n_choices_draw_as_vllms_parallel_sampling_does(front):
    """Choice i samples with seed + i; the prompt's logprobs are asked for once; usage counts
    the prompt once and every choice's tokens."""
    body = {"prompt": "a b c", "n": 3, "max_tokens": 2, "seed": 40, "temperature": 1.0, "prompt_logprobs": 1}
    response = _post(front, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert all(c["text"] == " w0 w1" and c["prompt_logprobs"][0] is None for c in answer["choices"])
    requests = front._orchestrator.requests[-3:]
    assert [r.sampling.seed for r in requests] == [40, 41, 42]
    assert [r.sampling.prompt_logprobs for r in requests] == [1, None, None]
    prompt = len(requests[0].prompt_token_ids)
    assert answer["usage"]["prompt_tokens"] == prompt and answer["usage"]["completion_tokens"] == 6


def test_n_choices_stream_with_their_index_role_and_finish(front):
    body = {"messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    chunks = _events(_post(front, CHAT, body))
    for index in (0, 1):
        deltas = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert deltas[0]["delta"]["role"] == "assistant"
        assert "".join(d["delta"].get("content", "") for d in deltas) == " w0 w1 w2"
        assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_echo_returns_the_prompt_with_its_logprobs_before_the_output(front, tokenizer):
    prompt = "Why split prefill from decode?"
    ids = tokenizer.encode(prompt)
    answer = _post(front, COMPLETIONS, {"prompt": prompt, "echo": True, "max_tokens": 2, "logprobs": 1}).json()
    choice = answer["choices"][0]
    assert choice["text"] == prompt + " w0 w1"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 2
    assert logprobs["token_logprobs"][0] is None and logprobs["token_logprobs"][1] == -1.5  # the prompt's own token
    assert front._orchestrator.requests[-1].sampling.prompt_logprobs == 1  # vLLM's: echo asks as many as logprobs
    streamed = _events(_post(front, COMPLETIONS, {"prompt": ids, "echo": True, "max_tokens": 2, "stream": True}))
    assert streamed[0]["choices"][0]["text"] == tokenizer.decode(ids) + " w0"


def test_echo_with_max_tokens_0_returns_the_prompt_alone(front):
    body = {"prompt": "a b c", "echo": True, "max_tokens": 0, "logprobs": 0}
    choice = _post(front, COMPLETIONS, body).json()["choices"][0]
    assert choice["text"] == "a b c"
    assert len(choice["logprobs"]["tokens"]) == len(front._orchestrator.requests[-1].prompt_token_ids)
    assert front._orchestrator.requests[-1].sampling.max_tokens == 1


def test_chat_echo_repeats_the_assistants_last_words(front):
    messages = [*MESSAGES, {"role": "assistant", "content": "Because"}]
    body = {"messages": messages, "echo": True, "max_tokens": 2, "add_generation_prompt": False,
            "continue_final_message": True}  # fmt: skip
    answer = _post(front, CHAT, body).json()
    assert answer["choices"][0]["message"] == {**answer["choices"][0]["message"], "content": "Because w0 w1"}
    assert answer["prompt_logprobs"][0] is None  # vLLM's chat echo asks for top_logprobs (0) of the prompt
    plain = _post(front, CHAT, {"messages": MESSAGES, "echo": True, "max_tokens": 2}).json()
    assert plain["choices"][0]["message"]["content"] == " w0 w1"  # the user spoke last: nothing to echo


def bodies(path: str, model: str = MODEL):
    """Bodies a careless or hostile client sends: a valid request, some of whose fields (and
    some unknown ones) take values of every type, nested, out of range."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20))
    hostile = st.recursive(
        scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
        max_leaves=6,
    )  # fmt: skip
    small = st.integers(0, 21)  # edges included: 0 and 21 are refused where they are out of range
    text = st.one_of(st.sampled_from(["Prefill makes the state", "decode consumes it", "Why?"]), st.text(max_size=40))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": text})
    plausible = {
        "model": st.just(model),
        "prompt": st.one_of(text, st.lists(st.integers(-3, 3000), max_size=8)),
        "messages": st.lists(message, min_size=1, max_size=3),
        "input": st.one_of(text, st.lists(message, max_size=3)),
        "instructions": text,
        "max_output_tokens": small,
        "include": st.lists(
            st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2
        ),
        "store": st.booleans(),
        "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {}}]),
        "max_tokens": small,
        "max_completion_tokens": small,
        "n": st.sampled_from([1, 1.0, 2, 3, 17]),
        "prompt_logprobs": st.one_of(st.none(), small),
        "temperature": st.floats(0, 2.01),
        "top_p": st.floats(0, 1),
        "top_k": small,
        "logprobs": st.one_of(small, st.booleans()),
        "top_logprobs": small,
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
        "stop_token_ids": st.lists(st.integers(-3, 3000), max_size=3),
        "seed": st.integers(-(2**64), 2**64),
        "ignore_eos": st.booleans(),
        "user": st.text(max_size=5),
        "min_p": st.floats(0, 1.2),
        "presence_penalty": st.floats(-3, 3),
        "frequency_penalty": st.floats(-3, 3),
        "repetition_penalty": st.floats(0, 2),
        "logit_bias": st.dictionaries(st.integers(-1, 2100).map(str), st.floats(-150, 150), max_size=3),
        "allowed_token_ids": st.lists(st.integers(-1, 2100), max_size=4),
        "bad_words": st.lists(st.text(max_size=4), max_size=2),
        "min_tokens": small,
        "echo": st.booleans(),
        "response_format": st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}},
                {"type": "json_schema"},  # no schema
                {"type": "xml"},
            ]
        ),
        "structured_outputs": st.sampled_from(
            [{"choice": ["a", "b"]}, {"regex": "[0-9]+"}, {"choice": []}, {"json": ""}, {"regex": "a", "choice": ["x"]}]
        ),
    }

    def mostly(value):  # one value in eight hostile
        return st.integers(0, 7).flatmap(lambda k: hostile if k == 0 else value)

    fields = {name: mostly(value) for name, value in plausible.items()}
    key = {COMPLETIONS: "prompt", CHAT: "messages", RESPONSES: "input"}[path]
    required = {key: fields.pop(key)}
    return st.fixed_dictionaries(required, optional=fields).map(_consistent)


def _consistent(body: dict) -> dict:
    """Mostly the combinations a client means: stream options with a stream, top_logprobs with
    logprobs (where the other is not set at all: explicit conflicts stay)."""
    if isinstance(body.get("stream_options"), dict) and "stream" not in body:
        body["stream"] = True
    if type(body.get("top_logprobs")) is int and "logprobs" not in body and "messages" in body:
        body["logprobs"] = True
    return body


def test_no_body_gets_a_5xx_and_the_front_keeps_serving(front):
    """Hypothesis-generated bodies for the three endpoints: every answer is a 200 or an OpenAI
    error below 500 (the fake engines are never overloaded or down, so no 503/429 either)."""
    statuses: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        st.sampled_from([COMPLETIONS, CHAT, RESPONSES]).flatmap(lambda path: st.tuples(st.just(path), bodies(path))),
    )
    def check(case):
        path, body = case
        raw = json.dumps(body, allow_nan=True)
        # One in ten is not JSON at all, by count: a drawn integer's low end comes far more
        # often than its share.
        if sum(statuses.values()) % 10 == 0:
            raw = raw[:-1]
        response = _post(front, path, raw)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            assert_openai_error(response, response.status_code)
            assert response.status_code < 500, response.text
        elif path == RESPONSES:
            assert response.json()["object"] == "response" if body.get("stream") is not True else response.text
        elif body.get("stream") is True:
            _events(response)
        else:
            assert response.json()["choices"]

    check()
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20, statuses
    assert _get(front, "/health").json() == {"status": "ok"}
    assert _post(front, COMPLETIONS, {"prompt": "a b c", "max_tokens": 2}).status_code == 200


def test_floats_out_of_range_name_the_field(front):
    for field in ("temperature", "top_p"):
        for value in (-1.0, 3.0, math.inf):
            body = json.dumps({"prompt": "a b c", field: value}, allow_nan=True)
            assert_openai_error(_post(front, COMPLETIONS, body), 400, field)
