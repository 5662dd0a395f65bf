"""One request per honoured sampling field of the OpenAI front, and what a colocated vLLM
engine gives for each: tests/test_openai_http.py sends them through 1P+1D and compares.

Each case is an HTTP body (beside the prompt) and the SamplingConfig a colocated engine runs
for it; `changes` names the case without the field, whose output the field must change (or
the test would prove nothing). The embedded model is decisive on its corpus (top-2 margins of
5-10 nats), so sampled cases use an arbitrary-id prompt, where it is not."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from reference import NEAR_TIE_NATS, PROMPTS, prompt_of

from messages.requests import GenerateRequest, SamplingConfig, StructuredOutput

MAX_TOKENS = 16
# bf16 logprobs of one token differ between the colocated and the prefill engine on the
# arbitrary-id prompt, where activations are off the training distribution, by the CPU's
# bf16 support: up to 0.06 nats on one with AMX, 0.10 on an AVX512F one without bf16
# instructions (2026-12-07; in-corpus prompts agree to 0.01). Logprobs taken after the
# penalties case's -2.0 penalties would be off by up to 2 nats.
LOGPROB_TOLERANCE = 0.2
# Arbitrary ids, where the model's next tokens are not decisive. The model is retrained on
# each machine, so the one used is the first of these whose reference leaves every "any" case
# something to compare (reference_outputs).
ANY_PROMPTS = tuple(prompt_of(7, offset, 24) for offset in range(3, 11))
# The corpus's first document ends (in EOS) right after this prompt.
NEAR_EOS = "near_eos"


@dataclass(frozen=True)
class Case:
    prompt: str  # a key of the fixture's prompts
    body: dict[str, Any]  # the HTTP fields beside prompt and max_tokens
    sampling: dict[str, Any]  # the same as SamplingConfig fields, for the colocated engine
    changes: str | None = None  # the case this one must differ from
    logprobs: int | None = None  # compare this many alternatives' logprobs too
    max_tokens: int = MAX_TOKENS

    @property
    def sampled(self) -> bool:
        return self.sampling.get("temperature", 0) > 0


_GREEDY = {"temperature": 0}
_SEED_5 = {"temperature": 1.0, "seed": 5, "ignore_eos": True}
CASES: dict[str, Case] = {
    "greedy": Case("short", {**_GREEDY, "ignore_eos": True}, {"ignore_eos": True}),
    "logprobs": Case(
        "short", {**_GREEDY, "ignore_eos": True, "logprobs": 5}, {"ignore_eos": True, "logprobs": 5}, logprobs=5
    ),
    "logit_bias": Case("short", {**_GREEDY, "logit_bias": {"881": -100}}, {"logit_bias": ((881, -100.0),)}, "greedy"),
    "allowed_token_ids": Case(
        "short",
        {**_GREEDY, "allowed_token_ids": list(range(300, 881))},
        {"allowed_token_ids": tuple(range(300, 881))},
        "greedy",
    ),
    "bad_words": Case("short", {**_GREEDY, "bad_words": [" Batching"]}, {"bad_words": (" Batching",)}, "greedy"),
    # 3.0, not 2.0: the model is retrained on each machine, and on some its margins on the
    # corpus outweigh a penalty of 2 at every token.
    "repetition_penalty": Case("short", {**_GREEDY, "repetition_penalty": 3.0}, {"repetition_penalty": 3.0}, "greedy"),
    "include_stop_str_in_output": Case(
        "short",
        {**_GREEDY, "stop": [" multiple"], "include_stop_str_in_output": True},
        {"stop": (" multiple",), "include_stop_str_in_output": True},
        "stop",
    ),  # fmt: skip
    "stop": Case("short", {**_GREEDY, "stop": [" multiple"]}, {"stop": (" multiple",)}),
    # min_tokens == max_tokens: decode must be asked for one fewer (the first is prefill's),
    # or it refuses min_tokens > max_tokens; prefill's own token must not be the EOS.
    "min_tokens": Case(NEAR_EOS, {**_GREEDY, "min_tokens": 6}, {"min_tokens": 6}, "eos", max_tokens=6),
    "eos": Case(NEAR_EOS, dict(_GREEDY), {}, max_tokens=6),
    "seed": Case("any", {"temperature": 1.0, "seed": 6}, {"temperature": 1.0, "seed": 6}),
    "other_seed": Case("any", _SEED_5, _SEED_5, "seed"),
    # The truncations are measured against seed 5's draws, which pick a token other than the
    # most likely one early on (ignore_eos: a sampled EOS would leave nothing to compare).
    "top_k_top_p": Case(
        "any", {**_SEED_5, "top_k": 20, "top_p": 0.8}, {**_SEED_5, "top_k": 20, "top_p": 0.8}, "other_seed"
    ),
    "min_p": Case("any", {**_SEED_5, "min_p": 0.2}, {**_SEED_5, "min_p": 0.2}, "other_seed"),
    # The model's margins (5-10 nats even off its corpus, after a few tokens) outweigh any
    # positive penalty; negative ones make it repeat what it said, prefill's first token
    # included, which decode must count as a colocated engine does.
    "penalties": Case(
        "any",
        {**_GREEDY, "ignore_eos": True, "presence_penalty": -2.0, "frequency_penalty": -2.0},
        {"ignore_eos": True, "presence_penalty": -2.0, "frequency_penalty": -2.0},
        "greedy_any",
    ),  # fmt: skip
    "greedy_any": Case("any", {**_GREEDY, "ignore_eos": True}, {"ignore_eos": True}),
}
# Structured outputs: every choice and schema field closed, so that the model (which knows
# none of this) ends its output within MAX_TOKENS (the engines run without free whitespace in
# JSON: EngineConfig.disable_any_whitespace). The regex takes the words the model continues
# the short prompt with (it is decisive there) up to the blank line, and ends the output.
STAGE_SCHEMA = {
    "type": "object",
    "properties": {"stage": {"enum": ["prefill", "decode"]}, "remote": {"type": "boolean"}},
    "required": ["stage", "remote"],
    "additionalProperties": False,
}
STAGE_FORMAT = {"type": "json_schema", "json_schema": {"name": "stage", "schema": STAGE_SCHEMA}}
WORDS_REGEX = "( [a-z]+)+\n\n"
CASES |= {
    "json_schema": Case(
        "short",
        {**_GREEDY, "response_format": STAGE_FORMAT},
        {"structured": StructuredOutput("json", json.dumps(STAGE_SCHEMA))},
        "greedy",
        max_tokens=48,
    ),
    "choice": Case(
        "short",
        {**_GREEDY, "structured_outputs": {"choice": ["prefill", "decode"]}},
        {"structured": StructuredOutput("choice", ("prefill", "decode"))},
        "greedy",
    ),
    "regex": Case(
        "short",
        {**_GREEDY, "structured_outputs": {"regex": WORDS_REGEX}},
        {"structured": StructuredOutput("regex", WORDS_REGEX)},
        "greedy",
    ),
}
CHAT_MESSAGES = [{"role": "user", "content": "Prefill processes the prompt and creates state"}]
N_CHOICES = 3
PROMPT_LOGPROBS = 2


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # best first, top 20
    # Per prompt token (None for the first): (token id, logprob, rank, text), its own first.
    prompt_logprobs: tuple = ()

    @property
    def margins(self) -> list[float]:
        return [p[0][1] - p[1][1] if len(p) > 1 else float("inf") for p in self.logprobs]


@dataclass(frozen=True)
class Colocated:
    prompts: dict[str, tuple[int, ...]]
    outputs: dict[str, Output]
    chat_messages: list[dict[str, str]]


def _prompts(model_path: str) -> dict[str, tuple[int, ...]]:
    from vllm_engine.embedded_model.texts import EOS_ID, token_stream

    stream = token_stream(model_path)
    end = stream.index(EOS_ID)
    return {"short": PROMPTS["short"], NEAR_EOS: tuple(stream[end - 12 : end])}


async def _run(actor, request: GenerateRequest) -> Output:
    tokens, texts, logprobs, finish, prompt_logprobs = [], [], [], None, ()
    async for ref in actor.generate.remote(request):
        chunk = await ref
        tokens += chunk.token_ids
        texts.append(chunk.text)
        logprobs += chunk.logprobs
        finish = chunk.finish_reason
        prompt_logprobs = prompt_logprobs or chunk.prompt_logprobs
    return Output(tokens, "".join(texts), finish, logprobs, prompt_logprobs)


def reference_outputs(actor, model_path: str) -> Colocated:
    """Every case on the colocated engine `actor` (logprobs 20 for the margins: sampling is
    unchanged)."""
    import asyncio

    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from router.chat_prompt import prompt_ids

    prompts = _prompts(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts["chat"] = prompt_ids(tokenizer, ChatCompletionRequest(messages=CHAT_MESSAGES))

    async def run_cases(names: list[str]) -> dict[str, Output]:
        """At once, in one batch (greedy cases are compared up to their first near-tie, where
        batch shape cannot change a choice; seeded sampling is per request in vLLM)."""

        async def one(name: str) -> Output:
            case = CASES[name]
            sampling = SamplingConfig(**{"max_tokens": case.max_tokens, **case.sampling, "logprobs": 20})
            return await _run(actor, GenerateRequest(f"ref-{name}", prompts[case.prompt], sampling))

        return dict(zip(names, await asyncio.gather(*map(one, names))))

    async def all_cases() -> dict[str, Output]:
        any_cases = [name for name, case in CASES.items() if case.prompt == "any"]
        for prompt in ANY_PROMPTS:
            prompts["any"] = prompt
            outputs = await run_cases(any_cases)
            if all(why_not_comparable(CASES[n], outputs[n], outputs.get(CASES[n].changes)) is None for n in any_cases):
                break
        else:
            raise AssertionError(f"no arbitrary-id prompt leaves every case something to compare: {ANY_PROMPTS}")
        outputs |= await run_cases([name for name in CASES if name not in any_cases])
        chat = SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)
        outputs["chat_logprobs"] = await _run(actor, GenerateRequest("ref-chat", prompts["chat"], chat))
        # n > 1: vLLM's choice i samples with seed + i (the "seed" case is choice 0).
        for i in range(1, N_CHOICES):
            seeded = SamplingConfig(**{"max_tokens": MAX_TOKENS, **CASES["seed"].sampling, "logprobs": 20})
            seeded = dataclasses.replace(seeded, seed=seeded.seed + i)
            outputs[f"seed+{i}"] = await _run(actor, GenerateRequest(f"ref-seed{i}", prompts["any"], seeded))
        scored = SamplingConfig(max_tokens=1, prompt_logprobs=PROMPT_LOGPROBS, logprobs=20)
        outputs["prompt_logprobs"] = await _run(actor, GenerateRequest("ref-plp", prompts["short"], scored))
        return outputs

    return Colocated(prompts, asyncio.run(all_cases()), CHAT_MESSAGES)


def _token_id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.removeprefix("token_id:"))


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[float]  # the sampled tokens'
    top: list[dict[int, float]]  # completions' top_logprobs: the sampled token and `logprobs` others
    timings: dict[str, Any]  # pdserve_timings

    @property
    def first_from_prefill(self) -> bool:
        """The first token left with prefill's result, before the transfer and decode's step
        (else decode computed it: tests/test_disaggregated.py reads the timings the same way)."""
        t = self.timings
        if not t["decode_worker"]:  # prefill's token ended it
            return True
        assert t["transfer_s"] > 0, t
        return t["ttft_s"] < t["queue_s"] + t["prefill_s"] + t["transfer_s"] - 1e-4


def through_http(base: str, model: str, case: Case, prompt: tuple[int, ...]) -> Answer:
    """The case as one non-streamed completion of token ids (returned as ids, with the
    sampled token's logprob, or the case's alternatives)."""
    body = {
        "model": model, "prompt": list(prompt), "max_tokens": case.max_tokens, **case.body,
        "logprobs": case.logprobs or 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    for _ in range(5):
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        # On a loaded box a health poll can time out and the router prefill on decode for a
        # while (policy "local"): that run compares colocated with colocated, so go again.
        if response.json()["pdserve_timings"]["prefill_worker"] == "prefill-0":
            break
        time.sleep(1)
    else:
        raise AssertionError("no request went through the prefill engine")
    choice = response.json()["choices"][0]
    lp = choice["logprobs"]
    top = [{_token_id(t): v for t, v in position.items()} for position in lp["top_logprobs"]]
    tokens = [_token_id(t) for t in lp["tokens"]]
    return Answer(
        tokens, choice["text"], choice["finish_reason"], lp["token_logprobs"], top, response.json()["pdserve_timings"]
    )


def compared_length(case: Case, ref: Output) -> int:
    """How many tokens any correct run reproduces: all where the case samples (the same draws
    pick the same token but for a near-equal draw), else up to the reference's first near-tie
    (its margins are vLLM's raw logprobs, before the case's own processing)."""
    if case.sampled:
        return len(ref.tokens)
    return next((i for i, m in enumerate(ref.margins) if m < NEAR_TIE_NATS), len(ref.tokens))


def why_not_comparable(case: Case, ref: Output, baseline: Output | None) -> str | None:
    """Why the reference proves nothing for this case (None: it does): a near-tie too early,
    or the field changes nothing within the tokens compared (against the case without it)."""
    n = compared_length(case, ref)
    if n < min(3, len(ref.tokens)):
        return f"the reference has a near-tie at token {n}: too early to compare"
    if baseline is None:
        return None
    differs = next((i for i, (a, b) in enumerate(zip(ref.tokens, baseline.tokens)) if a != b), None)
    if differs is None:  # the same tokens: then their number, or the text (a stop string kept)
        same = (len(ref.tokens), ref.finish_reason, ref.text) == (
            len(baseline.tokens),
            baseline.finish_reason,
            baseline.text,
        )
        return "the field changes nothing" if same else None
    return f"the field changes token {differs}, past the {n} compared" if differs >= n else None


def assert_same_as_colocated(case: Case, got: Answer, ref: Output, baseline: Output | None) -> None:
    # The leg the field is honoured on: prefill samples the first token unless the field
    # needs decode to see the whole output (SamplingConfig.decoded_whole).
    assert got.first_from_prefill != SamplingConfig(**case.sampling).decoded_whole, got.timings
    reason = why_not_comparable(case, ref, baseline)
    assert reason is None, reason
    n = compared_length(case, ref)
    assert got.tokens[:n] == ref.tokens[:n], (got.tokens, ref.tokens)
    if n == len(ref.tokens):
        assert got.tokens == ref.tokens and got.finish_reason == ref.finish_reason
        if case.prompt != "any":  # arbitrary ids decode to broken UTF-8 the first chunk repairs
            assert got.text == ref.text
    for position in range(n):  # the sampled token's logprob, prefill's first included
        want = dict(ref.logprobs[position])[got.tokens[position]]
        assert abs(got.logprobs[position] - want) < LOGPROB_TOLERANCE, (position, got.logprobs[position], want)
    if case.logprobs:
        for position in range(n):
            ranked = ref.logprobs[position]
            # The alternatives clear of the first one left out (a near-tie there may swap them).
            cut = ranked[case.logprobs][1] if len(ranked) > case.logprobs else float("-inf")
            want = {t: v for t, v in ranked[: case.logprobs] if v - cut > 0.05}
            assert set(want) <= set(got.top[position]), (position, ranked[: case.logprobs + 1], got.top[position])
            assert all(abs(got.top[position][t] - v) < LOGPROB_TOLERANCE for t, v in want.items()), position
    if (structured := case.sampling.get("structured")) is not None:
        assert got.finish_reason == "stop", got  # the constraint ended it, not max_tokens
        assert_obeys(structured, got.text)


def assert_obeys(structured: StructuredOutput, text: str) -> None:
    """The output matches its constraint, as a client would check it."""
    import jsonschema

    if structured.kind == "json":
        jsonschema.validate(json.loads(text), json.loads(structured.spec))
    elif structured.kind == "choice":
        assert text in structured.spec, text
    else:
        assert structured.kind == "regex" and re.fullmatch(structured.spec, text), (structured, text)


def chat_logprobs_stream(base: str, model: str, messages: list[dict[str, str]]):
    """A streamed chat with logprobs and 3 alternatives: the first delta, the token ids and per
    token (the sampled logprob, [(id, logprob)] of the alternatives)."""
    body = {
        "model": model, "messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 3, "stream": True, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    first_delta, tokens, logprobs = None, [], []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if not chunk["choices"] or not chunk["choices"][0]["delta"]:
                continue
            first_delta = first_delta or chunk["choices"][0]["delta"]
            for entry in chunk["choices"][0]["logprobs"]["content"]:
                tokens.append(_token_id(entry["token"]))
                logprobs.append(
                    (entry["logprob"], [(_token_id(t["token"]), t["logprob"]) for t in entry["top_logprobs"]])
                )
    return first_delta, tokens, logprobs


__all__ = [
    "CASES",
    "Case",
    "Colocated",
    "assert_same_as_colocated",
    "chat_logprobs_stream",
    "dataclasses",
    "through_http",
]
