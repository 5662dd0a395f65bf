"""The shadow check's arithmetic and its knobs, without engines (tests/test_disaggregated.py
runs it on real ones: a true handoff agrees, wrong state diverges)."""

from __future__ import annotations

import math
import random

import pytest

from messages.requests import GenerateRequest, SamplingConfig
from messages.results import TokenChunk
from router.orchestrator import RouterPolicy
from router.shadow_verification import (
    TOLERANCE_NATS,
    ShadowVerifier,
    emitted_logprobs,
    first_divergence,
    without_logprobs,
)


def test_the_first_step_past_the_tolerance_is_the_divergence():
    served = [-0.5, -1.25, -2.0, -0.1]
    assert first_divergence(served, served) == (None, 0.0)
    assert first_divergence(served, [-0.5, -1.25 + TOLERANCE_NATS / 2, -2.0, -0.1])[0] is None
    step, gap = first_divergence(served, [-0.5, -1.25, -3.0, -5.0])
    assert step == 2 and gap == pytest.approx(4.9)
    assert first_divergence([-0.5, math.nan], [-0.5, -0.5]) == (1, math.inf), "a missing logprob is no agreement"


def test_the_emitted_tokens_logprobs_are_read_from_their_top_lists():
    chunk = TokenChunk(
        token_ids=(7, 9), text="ab", logprobs=(((3, -0.1), (7, -2.5)), ((9, -0.2),)), logprob_texts=(("a", "b"), ("c",))
    )
    assert emitted_logprobs(chunk) == [-2.5, -0.2]
    assert all(math.isnan(x) for x in emitted_logprobs(TokenChunk(token_ids=(1, 2), text="")))
    bare = without_logprobs(chunk)
    assert bare.token_ids == (7, 9) and bare.logprobs == () and bare.logprob_texts == ()


def test_a_checked_request_asks_the_engines_for_logprobs_and_keeps_the_clients_own():
    request = GenerateRequest("r", (1, 2, 3), SamplingConfig(max_tokens=4))
    assert ShadowVerifier.instrumented(request).sampling.logprobs == 0
    asked = GenerateRequest("r", (1, 2, 3), SamplingConfig(max_tokens=4, logprobs=5))
    assert ShadowVerifier.instrumented(asked) is asked


def test_the_fraction_samples_requests():
    request = GenerateRequest("r", (1, 2, 3))
    assert not ShadowVerifier(0.0, 16).wants(request)
    assert ShadowVerifier(1.0, 16).wants(request)
    some = ShadowVerifier(0.25, 16, random.Random(3))
    picked = sum(some.wants(request) for _ in range(4000))
    assert 800 < picked < 1200


@pytest.mark.parametrize(
    "fields, named", [({"verify_fraction": 1.5}, "verify_fraction"), ({"verify_tokens": 0}, "verify_tokens")]
)
def test_bad_knobs_are_refused_by_name(fields, named):
    with pytest.raises(ValueError, match=named):
        RouterPolicy(**fields)


def test_pdserve_verify_refuses_bad_settings_by_name(capsys):
    from cli.main import main

    assert main(["verify", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err
    assert main(["verify", "--prompt-lengths", "2"]) == 2
    assert "prompt_lengths must be >= 3" in capsys.readouterr().err
