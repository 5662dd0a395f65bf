"""The core path with real vLLM, real NIXL and real Ray: one prefill and one decode engine,
each in its own actor process, against a colocated engine of the same configuration."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
from pathlib import Path

import psutil
import pytest
import ray
from conftest import assert_no_blocks_held, run
from reference import (
    MAX_TOKENS,
    MIN_COMPARED,
    PROMPTS,
    assert_matches,
    collect,
    decode_tokens,
    make_request,
    prompt_of,
)

from kv_transfer.connector_config import TransferConfig
from messages.errors import HandleExpiredError, InvalidRequestError, TransferFailedError
from messages.requests import GenerateRequest, SamplingConfig

LEASE_S = 6


@pytest.fixture(scope="module")
def deployment(ray_cluster, engine_config, reference):
    from controller.deployment import Deployment, DeploymentConfig

    dep = Deployment(DeploymentConfig(engine=engine_config, transfer=TransferConfig(lease_s=LEASE_S)))
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def test_every_pair_is_handshaken_before_traffic(deployment):
    dep, orchestrator = deployment
    assert set(dep.health.handshakes) == {("prefill-0", "decode-0")}
    assert all(m.alive for m in orchestrator.prefill.members + orchestrator.decode.members)


def test_each_engine_keeps_to_its_own_core(deployment):
    """NixlConnector moves its thread to the host's last core; pdserve moves the engine back,
    so the prefill and decode engines run on different cores (one each, handed out in turn)."""
    dep, _ = deployment
    members = dep.prefill.members + dep.decode.members
    pids = ray.get([m.actor.pid.remote() for m in members])
    cores = [dep.config.engine_for(m.name.split("-")[0], i).cpu_cores for i, m in enumerate(members)]
    assert len(set(cores)) == min(len(members), len(os.sched_getaffinity(0)))
    for pid, core in zip(pids, cores):
        threads = os.listdir(f"/proc/{pid}/task")
        assert threads and all(os.sched_getaffinity(int(tid)) == {int(core)} for tid in threads), (pid, core)


def test_engines_run_at_normal_priority(deployment):
    """Ray would start them at nice 15, behind everything else on the node."""
    dep, _ = deployment
    pids = ray.get([m.actor.pid.remote() for m in dep.prefill.members + dep.decode.members])
    assert [psutil.Process(pid).nice() for pid in pids] == [os.nice(0)] * len(pids)


def test_reference_outputs_differ_per_prompt(reference):
    # Guards the comparisons below: equal outputs for different prompts would prove nothing.
    # (y_then_last_of_x is y itself: Y ends on X's last token, see reference.py.)
    by_prompt = {PROMPTS[name]: tuple(v.decisive) for name, v in reference.items()}
    assert len(set(by_prompt.values())) == len(by_prompt) == len(reference) - 1
    assert all(len(v.tokens) == MAX_TOKENS and len(v.decisive) >= MIN_COMPARED for v in reference.values())


@pytest.mark.parametrize("name", ["short", "over_one_block", "long"])
def test_disaggregated_equals_colocated(deployment, reference, name):
    dep, orchestrator = deployment
    tokens, result = run(collect(orchestrator.generate(make_request(name, f"pd-{name}"))))
    assert_matches(tokens, reference[name])
    assert result.finish_reason == "length" and result.completion_tokens == MAX_TOKENS
    assert result.prompt_tokens == len(PROMPTS[name])
    assert result.timings.ttft_s >= result.timings.prefill_s > 0
    assert_no_blocks_held(dep)


def test_concurrent_requests_equal_colocated(deployment, reference):
    dep, orchestrator = deployment
    names = ["short", "over_one_block", "long", "x", "y", "short"]

    async def all_streams():
        return await asyncio.gather(
            *(collect(orchestrator.generate(make_request(n, f"conc-{i}-{n}"))) for i, n in enumerate(names))
        )

    outputs = run(all_streams())
    for name, (tokens, result) in zip(names, outputs):
        assert_matches(tokens, reference[name])
        assert result.finish_reason == "length"
    assert_no_blocks_held(dep)


def test_decode_continues_the_transferred_state_not_its_own_prompt(deployment, reference):
    """Decode is asked for X but handed Y's KV blocks and DeltaNet state: if the state
    really moved, it continues Y (plus X's last token), which differs from X's own output."""
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    y_handle = run(_prefill(prefill, make_request("y", "swap-y"))).handle
    tokens = run(decode_tokens(decode, make_request("x", "swap-x"), y_handle))
    assert reference["x"].decisive[:MIN_COMPARED] != reference["y_then_last_of_x"].decisive[:MIN_COMPARED]
    assert_matches(tokens, reference["y_then_last_of_x"])
    assert_no_blocks_held(dep)


async def _prefill(actor, request):
    return await actor.prefill.remote(request)


def test_byte_accounting_matches_the_model(deployment, model_path):
    dep, _ = deployment
    prefill = dep.prefill.members[0].actor
    config = json.loads((Path(model_path) / "config.json").read_text())
    layer_types = config["layer_types"]
    n_attn = layer_types.count("full_attention")
    n_gdn = layer_types.count("linear_attention")
    # Attention: K and V per layer per token, bf16.
    attn_per_token = n_attn * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    # Gated DeltaNet: conv state (kernel-1) x conv channels in bf16 + fp32 temporal state.
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2
    temporal = config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"] * 4
    layout = ray_get(prefill.state_layout.remote())
    block = next(g.block_size for g in layout.groups if g.block_size)

    seen = []
    for name in ["short", "over_one_block", "long"]:
        handle = run(_prefill(prefill, make_request(name, f"bytes-{name}"))).handle
        # Prefill holds N-1 tokens on hybrids; whole blocks move.
        assert handle.num_tokens == len(PROMPTS[name]) - 1
        assert handle.bytes.attention_kv == math.ceil(handle.num_tokens / block) * block * attn_per_token
        assert handle.bytes.deltanet_state == n_gdn * (conv + temporal)
        seen.append(handle.bytes)
    assert seen[0].attention_kv < seen[1].attention_kv < seen[2].attention_kv
    assert len({b.deltanet_state for b in seen}) == 1
    # Never decoded: the producer's lease frees the blocks.
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)


def ray_get(ref):
    import ray

    return ray.get(ref)


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ((), SamplingConfig(), "prompt"),
        (prompt_of(1, 0, 8190), SamplingConfig(max_tokens=8), "prompt"),
        ((1, 2, 3), SamplingConfig(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_input_is_refused_by_router_and_workers(deployment, prompt, sampling, field):
    dep, orchestrator = deployment
    request = GenerateRequest(f"bad-{field}", prompt, sampling)
    with pytest.raises(InvalidRequestError) as err:
        run(collect(orchestrator.generate(request)))
    assert err.value.field == field
    # Workers check too (they may be called by other routers).
    with pytest.raises(InvalidRequestError):
        run(_prefill(dep.prefill.members[0].actor, request))
    with pytest.raises(InvalidRequestError):
        run(decode_tokens(dep.decode.members[0].actor, request))
    assert_no_blocks_held(dep)


def test_handle_for_unknown_engine_fails_cleanly(deployment):
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    handle = run(_prefill(prefill, make_request("short", "ghost-src"))).handle
    ghost = dataclasses.replace(
        handle,
        engine_id="prefill-ghost",
        port=1,
        connector_params={**handle.connector_params, "remote_engine_id": "prefill-ghost", "remote_port": 1},
    )
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_tokens(decode, make_request("short", "ghost-dst"), ghost))
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)


def test_expired_handle_is_refused_and_lease_frees_blocks(deployment):
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    handle = run(_prefill(prefill, make_request("long", "expire-src"))).handle
    load = ray_get(prefill.load.remote())
    assert load.held_for_transfer == 1 and load.free_blocks < load.total_blocks
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)  # the lease ran out
    with pytest.raises(HandleExpiredError, match="expired"):
        run(decode_tokens(decode, make_request("long", "expire-dst"), handle))
    assert_no_blocks_held(dep)
