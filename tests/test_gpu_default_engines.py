"""The engines as GPUs run them, once on CPU through P/D with NIXL: vLLM's AsyncLLM path
(engine core in its own process, async scheduling) with compiled kernels (torch.compile,
`--no-enforce-eager`: what bench/vs_vllm.py measures), so the code GPUs use is exercised here.
Compiled kernels round differently from eager ones in bf16: comparisons with the eager
reference stop at its first near-tie (its `decisive` tokens, at least MIN_COMPARED = 64)."""

from __future__ import annotations

import dataclasses

import psutil
import pytest
import ray
from conftest import assert_no_blocks_held, engine_counter, run
from reference import assert_matches, collect, make_request

from controller.deployment import Deployment, DeploymentConfig

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)


@pytest.fixture(scope="module")
def deployment(ray_cluster, engine_config, reference):
    # A 2,048-token step budget (the default 8,192 prompts fit in 1,100): vLLM's warm-up runs
    # a step of the whole budget through the compiled model, 10 s of the start here.
    gpu_default = dataclasses.replace(
        engine_config, engine_path="async", enforce_eager=False, max_num_batched_tokens=2048
    )
    dep = Deployment(DeploymentConfig(engine=gpu_default))
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def test_each_engine_core_runs_in_its_own_process(deployment):
    dep, _ = deployment
    for member in dep.prefill.members + dep.decode.members:
        assert ray.get(member.actor.engine_path.remote()) == "async"
        children = psutil.Process(ray.get(member.actor.pid.remote())).children(recursive=True)
        # The engine core is the child that runs the model (torch mapped in). Its process
        # title ("VLLM::EngineCore") is no reliable mark: CI once read it still unset.
        running_torch = [p for p in children if any("libtorch" in m.path for m in p.memory_maps())]
        assert running_torch, (member.name, [" ".join(p.cmdline()) for p in children])


@pytest.mark.parametrize("name", ["over_one_block", "long"])
def test_async_compiled_engines_disaggregated_equal_eager_colocated(deployment, reference, name):
    dep, orchestrator = deployment
    decode = dep.decode.members[0].actor
    before = engine_counter(decode, "pdserve_handoff_digest_checks", "outcome").get("checked", 0)
    tokens, result = run(collect(orchestrator.generate(make_request(name, f"async-{name}"))))
    assert_matches(tokens, reference[name])
    assert result.timings.transfer_bytes.deltanet_state > 0
    # The engine core's worker process checked the pulled state against the producer's digests.
    assert engine_counter(decode, "pdserve_handoff_digest_checks", "outcome").get("checked", 0) == before + 1
    assert_no_blocks_held(dep)


def test_async_engines_report_capacity_and_load(deployment):
    import torch

    dep, _ = deployment
    for member in dep.prefill.members + dep.decode.members:
        capacity = dep.capacities[member.name]
        load = ray.get(member.actor.load.remote())
        assert capacity.kv_blocks == load.total_blocks > 0
        # torch's own probe of the CPU, not the /proc/cpuinfo flags the engine read
        bf16_cpu = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        assert capacity.bf16_without_cpu_support is not bf16_cpu
        assert load.free_blocks == load.total_blocks and not load.running
