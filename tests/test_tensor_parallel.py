"""Tensor-parallel engines with real vLLM, NIXL and Ray: TP 2 -> 2 served over gRPC (built
from the same flags as `pdserve serve --prefill-tp 2 --decode-tp 2`), and TP 2 -> 1, each
against a colocated engine at the decode side's TP, up to the reference's first near-tie.

On CPU each rank is a process of the engine actor with its own core list
("0|1": rank 0 on core 0, rank 1 on core 1): the same code GPUs run with one GPU per rank.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import psutil
import pytest
import ray
from conftest import ServedStack, assert_no_blocks_held, engine_counter, run, stream_tokens
from reference import MIN_COMPARED, PROMPTS, assert_matches, decode_after, make_request, reference_runs

from router.client import build_request
from controller.deployment import Deployment, DeploymentConfig
from vllm_engine.config import EngineSizing
from vllm_engine.sizing import DTYPE_BYTES, ssm_state_dtype

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)

TP2 = EngineSizing(tensor_parallel_size=2)


def _deployment_from_flags(model_path: str, *flags: str) -> DeploymentConfig:
    """The DeploymentConfig `pdserve serve` builds from these flags."""
    import argparse

    from cli.config import ServeConfig
    from configuration.flags import add_flags, build

    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    return build(ServeConfig, parser.parse_args(["--model", model_path, *flags])).deployment


@pytest.fixture(scope="module")
def served_tp2(ray_cluster, model_path):
    config = _deployment_from_flags(model_path, "--prefill-tp", "2", "--decode-tp", "2")
    assert config.role_engine("prefill").tensor_parallel_size == config.role_engine("decode").tensor_parallel_size == 2
    served = ServedStack(Deployment(config), model_path)
    yield served
    served.close()


@pytest.fixture(scope="module")
def reference_tp2(served_tp2):
    """Colocated at TP 2: the decode engine serving the prompts alone, without a handle (an
    engine of its own would cost three more processes), under a cache salt no P/D request
    carries."""
    decode = served_tp2.dep.decode.members[0].actor
    references = run(reference_runs(decode, ["short", "over_one_block", "long", "x", "y_tp2"], "ref2", "colocated"))
    assert_no_blocks_held(served_tp2.dep)
    return references


@pytest.mark.parametrize("name", ["short", "over_one_block", "long"])
def test_tp2_to_tp2_over_grpc_equals_colocated_tp2(served_tp2, reference_tp2, name):
    request = build_request(
        list(PROMPTS[name]), f"tp2-{name}", max_tokens=len(reference_tp2[name].tokens), ignore_eos=True
    )
    decode = served_tp2.dep.decode.members[0].actor
    checks = lambda: engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")  # noqa: E731
    before = checks()
    tokens, _, final = served_tp2.call(lambda ch: stream_tokens(ch, request))
    assert_matches(tokens, reference_tp2[name])
    assert final.prefill_worker == "prefill-0" and final.timings.attention_kv_bytes > 0
    # Each decode rank checked what it read from its producer rank (the digests reach the
    # rank processes in the scheduler's step metadata).
    after = checks()
    assert {o: after.get(o, 0) - before.get(o, 0) for o in ("checked", "unchecked")} == {"checked": 1, "unchecked": 0}
    assert_no_blocks_held(served_tp2.dep)


def test_tp2_decode_continues_the_transferred_state(served_tp2, reference_tp2):
    """Control: decode asked for X but handed Y's blocks and state from both ranks continues Y."""
    dep = served_tp2.dep
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    y_result = ray.get(prefill.prefill.remote(make_request("y_tp2", "tp2-swap-y")))
    tokens = run(decode_after(decode, y_result, make_request("x", "tp2-swap-x")))
    assert reference_tp2["x"].decisive[:MIN_COMPARED] != reference_tp2["y_tp2"].decisive[:MIN_COMPARED]
    assert_matches(tokens, reference_tp2["y_tp2"])
    assert_no_blocks_held(dep)


def test_tp2_byte_accounting_covers_every_rank(served_tp2, model_path):
    """Each rank holds half the heads under the same block ids: the handle counts both halves,
    so the totals equal the model's whole-request formulas, as at TP 1."""
    dep = served_tp2.dep
    prefill = dep.prefill.members[0].actor
    config = json.loads((Path(model_path) / "config.json").read_text())
    n_attn = config["layer_types"].count("full_attention")
    n_gdn = config["layer_types"].count("linear_attention")
    attn_per_token = n_attn * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2
    state_bytes = DTYPE_BYTES[ssm_state_dtype("cpu", "bfloat16")]  # as vLLM keeps it on this CPU
    heads = config["linear_num_value_heads"]
    temporal = heads * config["linear_key_head_dim"] * config["linear_value_head_dim"] * state_bytes
    layout = ray.get(prefill.state_layout.remote())
    assert layout.tensor_parallel_size == 2
    block = next(g.block_size for g in layout.groups if g.block_size)
    handle = ray.get(prefill.prefill.remote(make_request("long", "tp2-bytes"))).handle
    assert handle.bytes.attention_kv == math.ceil(handle.num_tokens / block) * block * attn_per_token
    assert handle.bytes.deltanet_state == n_gdn * (conv + temporal)
    # Never decoded: released as a router releases a cancelled request's (not at lease end).
    ray.get(dep.decode.members[0].actor.release_transfer.remote(handle))
    assert_no_blocks_held(dep, timeout_s=10)


def test_each_rank_keeps_to_its_own_core(served_tp2):
    """NixlConnector moves the thread that builds it onto the host's last core, in every rank
    process; pdserve's vLLM plugin puts it back, so rank 0 runs its forward on core 0 and
    rank 1 on core 1, and lets NIXL's own threads run on any core."""
    host = os.sched_getaffinity(0)
    for member in served_tp2.dep.prefill.members + served_tp2.dep.decode.members:
        actor_pid = ray.get(member.actor.pid.remote())
        ranks = _rank_processes(actor_pid)
        assert len(ranks) == 2, (member.name, [(p.pid, p.cmdline()) for p in psutil.Process(actor_pid).children(True)])
        homes = []
        for proc in ranks:
            home = os.sched_getaffinity(proc.pid)  # the rank's main thread runs its forward
            affinities = {frozenset(os.sched_getaffinity(t.id)) for t in proc.threads()}
            assert affinities <= {frozenset(home), frozenset(host)}, (member.name, proc.pid, affinities)
            homes.append(frozenset(home))
        assert sorted(homes, key=min) == [frozenset({0}), frozenset({1})], (member.name, homes)


def test_engine_and_its_ranks_share_one_placement_group_on_one_node(served_tp2):
    from ray.util import placement_group_table

    dep = served_tp2.dep
    for member in dep.prefill.members + dep.decode.members:
        table = placement_group_table(dep._placements[member.name])
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        bundle_nodes = set(table["bundles_to_node_id"].values())
        # A lambda travels by value (this test module is not importable inside the actor).
        where = lambda actor: (  # noqa: E731
            ray.get_runtime_context().get_node_id(),
            ray.get_runtime_context().get_placement_group_id(),
        )
        node_id, placement_id = ray.get(member.actor.__ray_call__.remote(where))
        assert placement_id == table["placement_group_id"]
        assert bundle_nodes == {node_id}
        # vLLM's ranks are processes of the actor, so they run inside its reservation.
        assert len(_rank_processes(ray.get(member.actor.pid.remote()))) == 2


def test_capacity_reported_by_each_engine_matches_pdserve_plan(served_tp2, model_path):
    """What vLLM built (blocks per rank, block size) is what `pdserve plan` computed from
    config.json alone: the sizing arithmetic is checked against the real engines."""
    from vllm_engine.sizing import ModelShape, plan_for

    dep = served_tp2.dep
    assert set(dep.capacities) == {"prefill-0", "decode-0"}
    shape = ModelShape.from_model_dir(model_path)
    for member in dep.prefill.members + dep.decode.members:
        capacity = dep.capacities[member.name]
        plan = plan_for(dep.config.role_engine(member.name.split("-")[0]), shape)
        assert capacity.tensor_parallel_size == 2
        assert capacity.kv_blocks == plan.usable_blocks
        assert capacity.deltanet_state_slots == capacity.kv_blocks
        assert capacity.blocks_per_max_length_request == plan.blocks_for(plan.inputs.max_model_len)
        assert capacity.max_concurrent_max_length_requests == plan.max_requests(plan.inputs.max_model_len)
        layout = ray.get(member.actor.state_layout.remote())
        assert {g.block_size for g in layout.groups if g.block_size} == {plan.block_size}


def test_tp2_prefill_hands_off_to_tp1_decode(served_tp2, shared_deployment, reference):
    """TP 2 -> 1: the TP 2 prefill engine above hands off to the session's TP 1 decode engine
    (a decode engine reads from any producer of the model it can reach). Then the long prompt
    again, with prefix hits on both sides: the TP 2 prefill engine reuses its blocks up to
    its checkpoint, the TP 1 decode engine its own attention blocks."""
    prefill = served_tp2.dep.prefill.members[0].actor
    decode = shared_deployment.decode.members[0].actor
    checks = lambda: engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")  # noqa: E731
    before = checks()

    def handed_off(name: str, request_id: str):
        result = ray.get(prefill.prefill.remote(make_request(name, request_id)))
        tokens = run(decode_after(decode, result, make_request(name, request_id)))
        assert_matches(tokens, reference[name])
        return result

    for name in ["over_one_block", "long"]:
        handed_off(name, f"tp21-{name}")
    again = handed_off("long", "tp21-long-again")
    block = served_tp2.dep.capacities["prefill-0"].block_size
    assert again.cached_tokens == (len(PROMPTS["long"]) - 1) // block * block
    # Each block decode filled from two ranks' halves was checked against the sum of their
    # digests (the last handoff read only what decode's own cache lacked).
    after = checks()
    assert {o: after.get(o, 0) - before.get(o, 0) for o in ("checked", "unchecked")} == {"checked": 3, "unchecked": 0}
    assert_no_blocks_held(served_tp2.dep)
    assert_no_blocks_held(shared_deployment)


def test_stopped_tp2_engines_leave_no_shared_memory(served_tp2):
    """The TP 2 deployment's last test stops it. Its engines are asked to stop before they
    are killed, so vLLM unlinks the shared-memory queues between each engine and its rank
    processes; a kill alone leaves them in /dev/shm (Ray kills the resource tracker too)."""
    held = set()
    for member in served_tp2.dep.prefill.members + served_tp2.dep.decode.members:
        engine = psutil.Process(ray.get(member.actor.pid.remote()))
        for process in [engine, *engine.children(recursive=True)]:
            held |= {m.path for m in process.memory_maps() if m.path.startswith("/dev/shm/psm_")}
    assert held, "a TP engine and its ranks talk through shared-memory queues"
    served_tp2.close()
    assert [path for path in held if os.path.exists(path)] == []


def test_unsupported_tp_pairing_is_refused_before_any_engine_starts():
    with pytest.raises(ValueError, match="one TP size must be a multiple of the other"):
        DeploymentConfig(
            prefill_sizing=EngineSizing(tensor_parallel_size=2), decode_sizing=EngineSizing(tensor_parallel_size=3)
        )


def test_role_switching_with_per_pool_engine_settings_is_refused():
    with pytest.raises(ValueError, match="both pools run one engine configuration"):
        DeploymentConfig(switch_roles=True, decode_sizing=EngineSizing(max_num_seqs=64))
    with pytest.raises(ValueError, match="--prefill >= 1"):
        DeploymentConfig(switch_roles=True, num_prefill=0)


def test_tp_that_cannot_split_the_heads_is_refused(ray_cluster, engine_config):
    tp3 = EngineSizing(tensor_parallel_size=3)
    dep = Deployment(DeploymentConfig(engine=engine_config, prefill_sizing=tp3, decode_sizing=tp3))
    with pytest.raises(ValueError, match="prefill engine \\(TP 3\\).*heads"):
        run(dep.start())
    assert not dep.prefill.members and not dep.decode.members


def test_kv_cache_too_small_for_one_request_is_refused_with_the_arithmetic(ray_cluster, engine_config):
    dep = Deployment(DeploymentConfig(engine=engine_config, decode_sizing=EngineSizing(kv_cache_bytes=4 << 20)))
    with pytest.raises(
        ValueError, match=r"decode engine .*one 8,192-token request needs \d+ blocks.*holds \d+.*--kv-cache-bytes"
    ):
        run(dep.start())
    assert not dep.prefill.members and not dep.decode.members


def _rank_processes(actor_pid: int) -> list[psutil.Process]:
    """vLLM's TP worker processes under an engine actor (spawned by its mp executor)."""
    children = psutil.Process(actor_pid).children(recursive=True)
    # Everything the actor spawned but multiprocessing's resource tracker (vLLM titles the
    # ranks VLLM::Worker_TP<rank> once they run).
    return [p for p in children if "resource_tracker" not in " ".join(p.cmdline())]
