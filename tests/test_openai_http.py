"""The OpenAI-compatible HTTP front, driven by the official `openai` client and by vLLM's own
`vllm bench serve`, against a real cluster (real engines, real NIXL)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import openai
import pytest
from conftest import ServedStack, _engines_idle, assert_no_blocks_held, wait_until


MODEL = "pdserve-embedded"
PROMPT = "Prefill processes the prompt and creates state; decode consumes that state"


@pytest.fixture(scope="module")
def served(shared_deployment, model_path, colocated):
    """The session's 1P+1D (JSON outputs without free whitespace: openai_cases.STAGE_SCHEMA
    says why) behind the OpenAI front."""
    from router.chat_parsing import ChatParsers

    chat = ChatParsers(tool_call_parser="hermes", enable_auto_tool_choice=True)
    stack = ServedStack(shared_deployment, model_path, http_model=MODEL, chat=chat)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def colocated(colocated_engine, model_path):
    """Each field case's output on a colocated engine (no connector, one engine does all)."""
    from openai_cases import reference_outputs

    return reference_outputs(colocated_engine, model_path)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://{served.http.address}/v1", api_key="none", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streamed_completion_matches_the_whole_one_and_reports_usage(client, served):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text
    # The same logprobs streamed (the first chunk's from prefill) as in the whole answer.
    streamed = [
        lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=0.1) and len(streamed) == 16
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    usage = chunks[-1].usage
    assert usage.completion_tokens == 16 == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 5
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals[-1].choices[0].finish_reason == "length"
    timings = finals[-1].model_extra["pdserve_timings"]  # the extension field
    assert timings["prefill_worker"] == "prefill-0" and timings["deltanet_state_bytes"] > 0
    assert_no_blocks_held(served.dep)


def test_chat_completion_streams_and_reports_usage(client):
    messages = [{"role": "user", "content": "Why split prefill from decode?"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens <= 12
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_errors_map_to_openai_status_codes(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=5.0)
    assert err.value.status_code == 400 and "temperature" in str(err.value)
    assert err.value.body["param"] == "temperature" and err.value.body["code"] is None  # OpenAI: a string or null
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=17)


def test_client_disconnect_mid_stream_frees_the_blocks(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"http://{served.http.address}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break  # leave: the connection closes here
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_client_leaving_a_request_that_is_not_streamed_aborts_it(served):
    """Nothing is written to a non-streamed request until it ends, so the front watches the
    connection: closing it frees the request's blocks on every engine within a second."""
    import socket
    import time

    host, port = served.http.address.rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        assert wait_until(lambda: not _engines_idle(served.dep), 30), "the request never started"
        time.sleep(0.5)  # decoding now
    left = time.monotonic()
    assert_no_blocks_held(served.dep, timeout_s=5)
    assert time.monotonic() - left < 1.5


def test_hostile_bodies_get_no_5xx_and_the_server_keeps_serving(served):
    """Generated bodies of both endpoints against the real 1P+1D deployment (the fast,
    many-example run is tests/test_openai_edges.py): no 5xx but 503/429, none hangs, and
    the server serves normally afterwards."""
    from test_openai_edges import CHAT, COMPLETIONS, assert_openai_error, bodies

    base = f"http://{served.http.address}"
    statuses: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from([COMPLETIONS, CHAT]).flatmap(lambda path: st.tuples(st.just(path), bodies(path, MODEL))))
    def check(case):
        path, body = case
        for key in ("max_tokens", "max_completion_tokens"):  # short answers (chat's default: the context's end)
            if type(body.get(key)) is int and body[key] > 4:
                body[key] = 4
        body.setdefault("max_tokens", 4)
        response = httpx.post(base + path, content=json.dumps(body, allow_nan=True), timeout=60,
                              headers={"content-type": "application/json"})  # fmt: skip
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            assert_openai_error(response, response.status_code)
            assert response.status_code < 500 or response.status_code in (503, 429), response.text

    check()
    # Both kinds came (about one body in ten is valid; how many of them depends on how the
    # tokenizer, trained on each machine, splits the generated texts).
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 5, statuses
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    normal = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    after = httpx.post(base + "/v1/completions", json=normal, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4, after.text
    assert_no_blocks_held(served.dep)


def _field_cases():
    from openai_cases import CASES

    return list(CASES)


@pytest.mark.parametrize("name", _field_cases())
def test_a_field_through_pd_gives_what_a_colocated_engine_gives(served, colocated, name):
    """One request per honoured sampling field through the HTTP front and 1P+1D: the same
    tokens (and logprobs) as a colocated vLLM engine on the same model, the first token
    (prefill's, or decode's where the field needs decode to sample all) included; and the
    field changed the output (against the same request without it)."""
    from openai_cases import CASES, assert_same_as_colocated, through_http

    case = CASES[name]
    got = through_http(f"http://{served.http.address}", MODEL, case, colocated.prompts[case.prompt])
    assert_same_as_colocated(case, got, colocated.outputs[name], colocated.outputs.get(case.changes))
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_fifty_json_schema_outputs_through_pd_all_validate(served):
    """50 sampled requests with a JSON schema (three schemas, both endpoints, at once): every
    output parses, validates, and ended because its JSON closed."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema
    from openai_cases import STAGE_SCHEMA

    schemas = [
        STAGE_SCHEMA,
        {"type": "object", "properties": {"tokens": {"type": "integer", "minimum": 1, "maximum": 4096}},
         "required": ["tokens"], "additionalProperties": False},
        {"type": "object", "properties": {"path": {"type": "array", "items": {"enum": ["router", "prefill", "decode"]},
                                                   "minItems": 1, "maxItems": 3}},
         "required": ["path"], "additionalProperties": False},
    ]  # fmt: skip

    def ask(i: int) -> None:
        schema = schemas[i % len(schemas)]
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{i % 3}", "schema": schema}}
        fields = {"model": MODEL, "max_tokens": 120, "temperature": 1.0, "seed": i, "response_format": response_format}
        if i % 2:
            path, body = "/v1/chat/completions", {**fields, "messages": [{"role": "user", "content": f"{PROMPT} {i}"}]}
        else:
            path, body = "/v1/completions", {**fields, "prompt": f"{PROMPT} {i}"}
        response = httpx.post(f"http://{served.http.address}{path}", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if i % 2 else choice["text"]
        assert choice["finish_reason"] == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(ask, range(50)))
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_a_structured_output_the_engine_cannot_compile_is_refused_by_name(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": "(unclosed"}}
    response = httpx.post(f"http://{served.http.address}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert "regex" in response.json()["error"]["message"], response.text
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_streamed_chat_logprobs_start_with_prefills_token(served, colocated):
    """Chat, streamed, logprobs with top_logprobs: the first delta holds the first token's
    logprobs (sampled by prefill) and the stream as a whole the colocated engine's."""
    from openai_cases import LOGPROB_TOLERANCE, chat_logprobs_stream

    first_delta, tokens, logprobs = chat_logprobs_stream(
        f"http://{served.http.address}", MODEL, colocated.chat_messages
    )
    ref = colocated.outputs["chat_logprobs"]
    assert first_delta["content"] and first_delta["role"] == "assistant"
    assert tokens == ref.tokens
    for position, (got, want) in enumerate(zip(logprobs, ref.logprobs)):
        assert got[0] == pytest.approx(want[0][1], abs=LOGPROB_TOLERANCE), position  # the sampled token's
        # The top 3, best first, each at the reference's logprob for it. Which of two candidates
        # within the tolerance comes first is a near-tie either engine may order either way (an
        # AMX CPU's kernels round otherwise than AVX-512's).
        alternatives = dict(want)  # the reference's top 20
        assert [lp for _, lp in got[1]] == sorted((lp for _, lp in got[1]), reverse=True), position
        for token, logprob in got[1]:
            assert logprob == pytest.approx(alternatives.get(token, -math.inf), abs=LOGPROB_TOLERANCE), position
        reference_third = want[2][1]
        assert all(lp >= reference_third - LOGPROB_TOLERANCE for _, lp in got[1]), position


def test_vllm_bench_serve_runs_a_poisson_benchmark_with_goodput(served, model_path, tmp_path):
    """vLLM's own benchmark against the endpoint (its module: the wheel's console script
    cannot start, see bench/vllm_bench_serve.py)."""
    command = [
        sys.executable, "-m", "bench.vllm_bench_serve", "--backend", "openai",
        "--base-url", f"http://{served.http.address}", "--endpoint", "/v1/completions",
        "--model", MODEL, "--tokenizer", model_path, "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "16", "--num-prompts", "16",
        "--request-rate", "4", "--goodput", "ttft:2000", "tpot:100", "--seed", "0",
        "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Successful requests:                     16" in run.stdout, run.stdout[-3000:]
    assert "Failed requests:" not in run.stdout or "Failed requests:                         0" in run.stdout
    assert "Request goodput (req/s):" in run.stdout


def _assert_prompt_logprobs(got: list, ref: tuple, prompt: list[int], top: int) -> None:
    """Each prompt token's logprob and rank, and the alternatives clear of a near-tie, as the
    colocated engine gave them (`got`: vLLM's JSON, {token id: {logprob, rank, ...}})."""
    from openai_cases import LOGPROB_TOLERANCE

    assert got[0] is None and ref[0] is None and len(got) == len(ref) == len(prompt)
    for position in range(1, len(prompt)):
        entries = {int(t): v for t, v in got[position].items()}
        own, *others = ref[position]
        assert own[0] == prompt[position]
        assert entries[own[0]]["logprob"] == pytest.approx(own[1], abs=LOGPROB_TOLERANCE), position
        clear = [t for t, lp, _, _ in others if all(abs(lp - o[1]) > 0.05 for o in others if o[0] != t)]
        assert set(clear[:top]) <= set(entries), (position, entries, others)


def test_prompt_logprobs_come_from_the_engine_that_computed_the_whole_prompt(served, colocated):
    """prompt_logprobs through P/D: from prefill where it samples the first token, from the
    decode engine (which then prefills the prompt itself) where decode samples every token
    (a seed); both equal a colocated engine's. And lm-eval-harness's scoring request (echo,
    max_tokens 0, logprobs) never leaves prefill."""
    from openai_cases import CASES, PROMPT_LOGPROBS

    prompt = list(colocated.prompts["short"])
    ref = colocated.outputs["prompt_logprobs"].prompt_logprobs
    url = f"http://{served.http.address}/v1/completions"
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "prompt_logprobs": PROMPT_LOGPROBS}
    for fields, prefill in (({"temperature": 0}, "prefill-0"), (CASES["seed"].body, "")):
        answer = httpx.post(url, json={**base, **fields}, timeout=120).json()
        assert answer["pdserve_timings"]["prefill_worker"] == prefill, answer["pdserve_timings"]
        _assert_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], ref, prompt, PROMPT_LOGPROBS)

    scoring = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    answer = httpx.post(url, json=scoring, timeout=120).json()
    assert answer["pdserve_timings"]["prefill_worker"] == "prefill-0" and not answer["pdserve_timings"]["decode_worker"]
    logprobs = answer["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) and logprobs["token_logprobs"][0] is None
    for position in range(1, len(prompt)):
        assert logprobs["token_logprobs"][position] == pytest.approx(ref[position][0][1], abs=0.1), position
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_n_choices_through_pd_draw_what_a_colocated_engines_choices_draw(served, colocated):
    """n = 3, seeded: choice i is what a colocated vLLM engine draws for it (seed + i)."""
    from openai_cases import CASES, MAX_TOKENS, N_CHOICES, _token_id

    body = {"model": MODEL, "prompt": list(colocated.prompts["any"]), "max_tokens": MAX_TOKENS, **CASES["seed"].body,
            "n": N_CHOICES, "logprobs": 0, "return_tokens_as_token_ids": True}  # fmt: skip
    answer = httpx.post(f"http://{served.http.address}/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in answer["choices"]] == list(range(N_CHOICES))
    for i, choice in enumerate(answer["choices"]):
        ref = colocated.outputs["seed" if i == 0 else f"seed+{i}"]
        assert [_token_id(t) for t in choice["logprobs"]["tokens"]] == ref.tokens, i
    assert len({tuple(c["logprobs"]["tokens"]) for c in answer["choices"]}) > 1  # the seeds differ
    assert answer["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in answer["choices"])
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_later_choices_start_from_the_first_ones_cached_prompt(served):
    """Choices after the first start once its prompt is in the prefill engine's prefix cache:
    they compute only what the cache does not hold."""
    import uuid

    from reference import PROMPTS

    block = next(iter(served.dep.capacities.values())).block_size
    prompt = list(PROMPTS["over_one_block"])
    assert len(prompt) > block
    body = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 4, "temperature": 0, "cache_salt": uuid.uuid4().hex}
    answer = httpx.post(f"http://{served.http.address}/v1/completions", json=body, timeout=120).json()
    first, second = answer["pdserve_choice_timings"]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= block, (first, second)
    assert answer["choices"][0]["text"] == answer["choices"][1]["text"]  # greedy
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_named_and_required_tool_calls_through_pd(served, model_path):
    """tool_choice named (streamed) and required, with vLLM's hermes parser: decode samples
    the whole call under the parser's structural tag; the answer is a call of the tools given,
    its arguments JSON, its finish reason OpenAI's."""
    from transformers import AutoTokenizer

    # The tag's JSON allows free whitespace, which this model (it knows no JSON) would emit
    # forever: a client's logit_bias bans every whitespace-only token.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    blank = {str(i): -100 for i in range(len(tokenizer)) if not tokenizer.decode([i]).strip() and i != 0}
    # Strict tools, their arguments closed (an enum): the grammar then bounds the call, and
    # the model (which knows none of this) ends it within max_tokens.
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lisbon"]}}, "required": ["city"],
            "additionalProperties": False}  # fmt: skip
    nothing = {"type": "object", "properties": {}, "additionalProperties": False}
    WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": city, "strict": True}}
    CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": nothing, "strict": True}}
    client = openai.OpenAI(base_url=f"http://{served.http.address}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=200, temperature=0,
        stream=True, logit_bias=blank,
    )  # fmt: skip
    calls, finish = {}, None
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += (call.function and call.function.name) or ""
            entry["arguments"] += (call.function and call.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [c["name"] for c in calls.values()] == ["get_weather"] and finish == "stop", (calls, finish)
    assert json.loads(calls[0]["arguments"])["city"] in ("Paris", "Lisbon")

    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200, temperature=0,
        logit_bias=blank,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and isinstance(
            json.loads(call.function.arguments), dict
        )
    assert answer.model_extra["pdserve_timings"]["prefill_worker"] == "prefill-0"
    assert_no_blocks_held(served.dep, timeout_s=10)


def test_auto_tool_choice_the_model_calls_a_tool_through_pd(client):
    """tool_choice auto, whole and streamed: the embedded model learned to answer this question
    with a call (corpus/transcript-tool-call.txt); prefill samples its first token, decode the
    rest, and vLLM's hermes parser makes the text tool_calls. With tool_choice none the same
    text stays content."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model=MODEL, messages=question, tools=[weather], max_tokens=96, temperature=0)  # the call: 58 tokens
    choice = client.chat.completions.create(**args, tool_choice="auto").choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    calls, finish = {}, None
    for chunk in client.chat.completions.create(**args, tool_choice="auto", stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += (delta.function and delta.function.name) or ""
            entry["arguments"] += (delta.function and delta.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0], (calls, finish)
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}

    declined = client.chat.completions.create(**args, tool_choice="none").choices[0]
    assert not declined.message.tool_calls and "<tool_call>" in declined.message.content, declined


def test_the_responses_api_through_pd_with_the_official_client(client):
    """Text in, text out, whole and streamed: the greedy answer chat completions gives for the
    same message, with the same usage, from vLLM's event sequence."""
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16, temperature=0
    )
    whole = client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert whole.model_extra["pdserve_timings"]["prefill_worker"] == "prefill-0"
    events = list(client.responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0, stream=True))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
