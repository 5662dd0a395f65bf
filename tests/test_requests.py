"""Request validation: every bad field gets an error that names it."""

import pytest

from messages.errors import InvalidRequestError
from messages.requests import MAX_STRUCTURED_CHARS, GenerateRequest, ModelLimits, SamplingConfig, StructuredOutput
from vllm_engine.sampling import sampling_params

LIMITS = ModelLimits(max_model_len=128, vocab_size=100)


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ((), SamplingConfig(), "prompt"),
        (tuple(range(100)), SamplingConfig(max_tokens=64), "prompt"),
        ((1, 2, 300), SamplingConfig(), "prompt_token_ids"),
        ((1,), SamplingConfig(max_tokens=0), "max_tokens"),
        ((1,), SamplingConfig(max_tokens=-3), "max_tokens"),
        ((1,), SamplingConfig(temperature=-0.1), "temperature"),
        ((1,), SamplingConfig(top_p=0.0), "top_p"),
        ((1,), SamplingConfig(top_p=1.5), "top_p"),
        ((1,), SamplingConfig(top_k=-1), "top_k"),
        ((1,), SamplingConfig(stop_token_ids=(5, 100)), "stop_token_ids"),
        ((1,), SamplingConfig(stop=("",)), "stop"),
        ((1,), SamplingConfig(temperature=2.5), "temperature"),  # vLLM's range; found by the hostile-input test
        ((1,), SamplingConfig(stop=("x",) * 17), "stop"),
        ((1,), SamplingConfig(stop=("x" * 257,)), "stop"),
        ((1,), SamplingConfig(stop_token_ids=(1,) * 257), "stop_token_ids"),
        ((1,), SamplingConfig(logprobs=21), "logprobs"),
        ((1,), SamplingConfig(logprobs=-1), "logprobs"),
        ((1,), SamplingConfig(min_p=1.5), "min_p"),
        ((1,), SamplingConfig(min_p=float("nan")), "min_p"),
        ((1,), SamplingConfig(presence_penalty=2.5), "presence_penalty"),
        ((1,), SamplingConfig(frequency_penalty=-3), "frequency_penalty"),
        ((1,), SamplingConfig(repetition_penalty=0), "repetition_penalty"),
        ((1,), SamplingConfig(repetition_penalty=float("inf")), "repetition_penalty"),
        ((1,), SamplingConfig(logit_bias=((100, 1.0),)), "logit_bias"),
        ((1,), SamplingConfig(logit_bias=((5, 101.0),)), "logit_bias"),
        ((1,), SamplingConfig(logit_bias=tuple((i % 100, 1.0) for i in range(1025))), "logit_bias"),
        ((1,), SamplingConfig(allowed_token_ids=()), "allowed_token_ids"),
        ((1,), SamplingConfig(allowed_token_ids=(3, 100)), "allowed_token_ids"),
        ((1,), SamplingConfig(bad_words=("",)), "bad_words"),
        ((1,), SamplingConfig(bad_words=("x",) * 17), "bad_words"),
        ((1,), SamplingConfig(max_tokens=4, min_tokens=5), "min_tokens"),
        ((1,), SamplingConfig(min_tokens=-1), "min_tokens"),
    ],
)
def test_invalid_field_is_named(prompt, sampling, field):
    with pytest.raises(InvalidRequestError) as err:
        GenerateRequest("r", prompt, sampling).validate(LIMITS)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


def test_minimum_prompt_length_of_the_model_is_enforced():
    limits = ModelLimits(max_model_len=128, vocab_size=100, min_prompt_tokens=2)
    with pytest.raises(InvalidRequestError, match="at least 2"):
        GenerateRequest("r", (1,), SamplingConfig()).validate(limits)
    GenerateRequest("r", (1, 2), SamplingConfig()).validate(limits)


def test_valid_request_passes_and_maps_to_vllm():
    request = GenerateRequest("r", (1, 2, 3), SamplingConfig(max_tokens=8, top_k=0, stop=("x",)))
    request.validate(LIMITS)
    params = sampling_params(request.sampling)
    assert params.max_tokens == 8 and params.top_k in (-1, 0) and params.stop == ["x"]


def test_a_continued_request_keeps_its_length_and_gets_a_seed_of_its_own():
    """Resumed after tokens already streamed (prefill's first token, a migration): the same
    total length; a seeded request draws fresh noise for what is left, reproducibly."""
    request = GenerateRequest("r", (1, 2, 3), SamplingConfig(max_tokens=10, seed=7))
    once = request.continued((4,))
    assert once.prompt_token_ids == (1, 2, 3, 4) and once.sampling.max_tokens == 9
    assert once.sampling.seed not in (None, 7) and once.sampling.seed == request.continued((4,)).sampling.seed
    assert request.continued((4, 5)).sampling.seed not in (7, once.sampling.seed)
    assert GenerateRequest("r", (1, 2), SamplingConfig(seed=None)).continued((3,)).sampling.seed is None
    assert 0 <= GenerateRequest("r", (1,), SamplingConfig(seed=-5)).continued((2,)).sampling.seed < 2**63


def test_vllms_further_settings_map_to_vllm():
    sampling = SamplingConfig(
        max_tokens=8, temperature=1.0, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        logit_bias=((5, -100.0),), allowed_token_ids=(5, 6), bad_words=("a b",), min_tokens=3,
        include_stop_str_in_output=True, logprobs=0,
    )  # fmt: skip
    GenerateRequest("r", (1, 2), sampling).validate(LIMITS)
    params = sampling_params(sampling)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.1,
        0.5,
        -0.5,
        1.2,
    )
    assert params.logit_bias == {5: -100.0} and params.allowed_token_ids == [5, 6] and params.bad_words == ["a b"]
    assert params.min_tokens == 3 and params.include_stop_str_in_output and params.logprobs == 0
    assert sampling_params(SamplingConfig()).logprobs is None


def test_min_tokens_counts_across_the_legs():
    """Prefill's one-token leg holds min_tokens' first token (its EOS masked); decode's leg is
    asked for the rest."""
    request = GenerateRequest("r", (1, 2, 3), SamplingConfig(max_tokens=6, min_tokens=6))
    assert sampling_params(request.sampling, max_tokens=1).min_tokens == 1
    decode = request.continued((4,))
    assert (decode.sampling.max_tokens, decode.sampling.min_tokens) == (5, 5)
    decode.validate(LIMITS)
    assert GenerateRequest("r", (1,), SamplingConfig(min_tokens=1)).continued((2, 3)).sampling.min_tokens == 0


@pytest.mark.parametrize(
    ("sampling", "whole"),
    [
        (SamplingConfig(), False),
        (SamplingConfig(logprobs=5, min_p=0.2, logit_bias=((1, 2.0),), allowed_token_ids=(1, 2)), False),
        (SamplingConfig(repetition_penalty=1.5, min_tokens=2, top_k=5, top_p=0.5, temperature=1.0), False),
        (SamplingConfig(seed=3), False),  # greedy: the seed draws nothing
        (SamplingConfig(seed=3, temperature=0.5), True),
        (SamplingConfig(stop=("x",)), True),
        (SamplingConfig(bad_words=("x",)), True),
        (SamplingConfig(presence_penalty=0.1), True),
        (SamplingConfig(frequency_penalty=-0.1), True),
        (SamplingConfig(structured=StructuredOutput("choice", ("a", "b"))), True),
    ],
)
def test_settings_over_the_whole_output_leave_every_token_to_decode(sampling, whole):
    assert sampling.decoded_whole is whole


@pytest.mark.parametrize(
    ("structured", "vllm_field", "value"),
    [
        (StructuredOutput("json", '{"type": "object"}'), "json", '{"type": "object"}'),
        (StructuredOutput("json_object", ""), "json_object", True),
        (StructuredOutput("regex", "[ab]+"), "regex", "[ab]+"),
        (StructuredOutput("choice", ("yes", "no")), "choice", ["yes", "no"]),
        (StructuredOutput("grammar", 'root ::= "x"'), "grammar", 'root ::= "x"'),
    ],
)
def test_a_structured_output_reaches_vllm_as_its_own_constraint(structured, vllm_field, value):
    params = sampling_params(SamplingConfig(structured=structured)).structured_outputs
    assert getattr(params, vllm_field) == value


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        (StructuredOutput("xml", "<a/>"), "kind 'xml'"),
        (StructuredOutput("regex", "a" * (MAX_STRUCTURED_CHARS + 1)), "at most"),
        (StructuredOutput("choice", ()), "1 to 256 choices"),
        (StructuredOutput("regex", "a\x00"), "NUL"),
    ],
)
def test_a_bad_structured_output_is_refused_by_name(structured, says):
    with pytest.raises(InvalidRequestError, match=says) as err:
        GenerateRequest("r", (1, 2), SamplingConfig(structured=structured)).validate(LIMITS)
    assert err.value.field == "structured_outputs"


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (SamplingConfig(min_p=0.1), "min_p"),
        (SamplingConfig(logit_bias=((3, 5.0),)), "logit_bias"),
        (SamplingConfig(forced_tokens=(3,)), "forced_tokens"),
    ],
)
def test_what_speculating_engines_would_ignore_is_refused_by_name(sampling, field):
    speculative = ModelLimits(max_model_len=128, vocab_size=100, speculative=True)
    with pytest.raises(InvalidRequestError) as err:
        GenerateRequest("r", (1, 2), sampling).validate(speculative)
    assert err.value.field == field and "--speculative-method" in str(err.value)
    GenerateRequest("r", (1, 2), sampling).validate(LIMITS)  # without speculation: fine
