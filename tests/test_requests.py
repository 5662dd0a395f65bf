"""Request validation: every bad field gets an error that names it."""

import pytest

from messages.errors import InvalidRequestError
from messages.requests import GenerateRequest, ModelLimits, SamplingConfig
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
