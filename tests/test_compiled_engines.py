"""The compiled engine path (`--no-enforce-eager`: torch.compile, vLLM's GPU default) through
P/D with NIXL on CPU: what bench/vs_vllm.py measures, checked for correctness."""

import dataclasses

import pytest
from conftest import assert_no_blocks_held, run
from reference import assert_matches, collect, make_request

from controller.deployment import Deployment, DeploymentConfig


@pytest.fixture(scope="module")
def compiled(ray_cluster, engine_config, reference):
    dep = Deployment(DeploymentConfig(engine=dataclasses.replace(engine_config, enforce_eager=False)))
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def test_compiled_engines_disaggregated_equal_eager_colocated(compiled, reference):
    """Compiled kernels round differently from eager ones in bf16; the comparison stops at the
    reference's first near-tie (its `decisive` tokens, at least MIN_COMPARED = 64)."""
    dep, orchestrator = compiled
    tokens, result = run(collect(orchestrator.generate(make_request("long", "compiled-long"))))
    assert_matches(tokens, reference["long"])
    assert result.timings.transfer_bytes.deltanet_state > 0
    assert_no_blocks_held(dep)
