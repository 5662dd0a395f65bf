"""Resizing live pools: requests keep flowing, none fails, removed actors drain first."""

import asyncio

import pytest
from conftest import assert_no_blocks_held, run
from reference import MAX_TOKENS, assert_matches, collect, make_request

from messages.membership import ScalingDecision


@pytest.fixture(scope="module")
def deployment(shared_deployment, reference):
    """The session's 1P+1D: grown to 1P+2D and shrunk back."""
    return shared_deployment


def test_grow_then_shrink_decode_pool_under_traffic(deployment, reference):
    dep = deployment
    orchestrator = dep.orchestrator

    async def traffic(tag: str, n: int):
        return await asyncio.gather(
            *(collect(orchestrator.generate(make_request("over_one_block", f"{tag}-{i}"))) for i in range(n))
        )

    async def scenario():
        grow = asyncio.ensure_future(dep.resize(ScalingDecision(1, 2, "test: grow")))
        during_grow = await traffic("grow", 4)
        assert (await grow).after == (1, 2)
        assert ("prefill-0", "decode-1") in dep.health.handshakes  # handshaken before traffic
        in_flight = asyncio.ensure_future(traffic("shrink", 6))
        leaving = dep.decode.members[1]
        for _ in range(300):  # shrink only once the leaving actor has requests to finish
            if leaving.outstanding_requests:
                break
            await asyncio.sleep(0.01)
        assert leaving.outstanding_requests, "no request was routed to the new decode actor"
        sizes = (await dep.resize(ScalingDecision(1, 1, "test: shrink"))).after
        return during_grow, await in_flight, sizes

    during_grow, during_shrink, sizes = run(scenario())
    assert sizes == (1, 1) and [m.name for m in dep.decode.members] == ["decode-0"]
    for tokens, result in during_grow + during_shrink:  # nothing failed during either change
        assert result.finish_reason == "length" and len(tokens) == MAX_TOKENS
        assert_matches(tokens, reference["over_one_block"])
    assert {r.decode_worker for _, r in during_shrink} == {"decode-0", "decode-1"}  # decode-1 drained them
    assert_no_blocks_held(dep)
