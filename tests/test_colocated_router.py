"""Colocated serving behind the same router (the baseline disaggregation is compared with)."""

import pytest
from conftest import assert_no_blocks_held, run
from reference import MAX_TOKENS, assert_matches, collect, make_request

from controller.deployment import Deployment, DeploymentConfig


@pytest.fixture(scope="module")
def colocated(ray_cluster, engine_config, reference):
    dep = Deployment(DeploymentConfig(engine=engine_config, num_prefill=0, num_decode=1))
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def test_colocated_deployment_generates_without_transfer(colocated, reference):
    dep, orchestrator = colocated
    assert orchestrator.colocated
    tokens, result = run(collect(orchestrator.generate(make_request("long", "colo-1"))))
    assert_matches(tokens, reference["long"])
    assert result.completion_tokens == MAX_TOKENS and result.prefill_worker == ""
    assert result.timings.transfer_bytes.total == 0 and result.timings.ttft_s > 0
    assert_no_blocks_held(dep)
