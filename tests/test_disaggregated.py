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
from conftest import assert_no_blocks_held, engine_counter, run
from reference import (
    MAX_TOKENS,
    MIN_COMPARED,
    PROMPTS,
    UNMATCHED_STOP,
    assert_matches,
    collect,
    decode_after,
    decode_tokens,
    make_request,
    prompt_of,
)

from injection import attention_blocks_shifted, state_slots, tamper_state, without_digests

from kv_transfer.digests import DIGESTS_KEY
from kv_transfer.layout import GroupKind
from messages.errors import InvalidRequestError, TransferFailedError
from messages.requests import GenerateRequest, SamplingConfig
from router.shadow_verification import ShadowVerifier, decode_on_handle, verify
from vllm_engine.cpu_affinity import python_thread_ids
from vllm_engine.sizing import DTYPE_BYTES, ssm_state_dtype


@pytest.fixture(scope="module")
def deployment(shared_deployment, reference):
    """The session's 1P+1D; each test leaves it as it found it."""
    return shared_deployment, shared_deployment.orchestrator


def test_every_pair_is_handshaken_before_traffic(deployment):
    dep, orchestrator = deployment
    assert set(dep.health.handshakes) == {("prefill-0", "decode-0")}
    assert all(m.live for m in orchestrator.prefill.members + orchestrator.decode.members)
    # And each pair's link was measured by a real READ of a request-sized buffer.
    (link,) = dep.links
    assert (link.source, link.reader, link.nbytes) == ("prefill-0", "decode-0", dep.config.transfer.link_probe_bytes)
    assert link.gbit_s > 0 and link.warning(floor_gbit_s=1e9) is not None and link.warning(0) is None


def test_each_engine_keeps_to_its_own_core(deployment):
    """NixlConnector moves its thread to the host's last core; pdserve moves the engine's
    Python threads back, so the prefill and decode engines run on different cores (one each,
    handed out in turn), and lets the native helpers (NIXL's progress thread, Ray's I/O) run
    on any core instead of preempting the forward."""
    dep, _ = deployment
    members = dep.prefill.members + dep.decode.members
    pids = ray.get([m.actor.pid.remote() for m in members])
    python_threads = ray.get([m.actor.__ray_call__.remote(lambda _: python_thread_ids()) for m in members])
    cores = [dep.config.engine_for(m.name.split("-")[0], i).cpu_cores for i, m in enumerate(members)]
    host = os.sched_getaffinity(0)
    assert len(set(cores)) == min(len(members), len(host))
    for pid, core, python in zip(pids, cores, python_threads):
        placement = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
        assert python and all(placement[tid] == {int(core)} for tid in python if tid in placement), (pid, core)
        assert all(where in ({int(core)}, host) for where in placement.values()), (pid, core, placement)
        assert any(where == host for tid, where in placement.items() if tid not in python), (pid, "no free helper")


def test_engines_run_at_normal_priority(deployment):
    """Ray would start them at nice 15, behind everything else on the node."""
    dep, _ = deployment
    pids = ray.get([m.actor.pid.remote() for m in dep.prefill.members + dep.decode.members])
    assert [psutil.Process(pid).nice() for pid in pids] == [os.nice(0)] * len(pids)


def test_reference_outputs_differ_per_prompt(reference):
    # Guards the comparisons below: equal outputs for different prompts would prove nothing.
    by_prompt = {PROMPTS[name]: tuple(v.decisive) for name, v in reference.items()}
    assert len(set(by_prompt.values())) == len(by_prompt) == len(reference)
    assert all(len(v.tokens) == MAX_TOKENS and len(v.decisive) >= MIN_COMPARED for v in reference.values())


@pytest.mark.parametrize("name", ["short", "over_one_block", "long"])
def test_disaggregated_equals_colocated(deployment, reference, name):
    """Prefill samples the first token and streams it; decode continues from it."""
    dep, orchestrator = deployment
    tokens, result = run(collect(orchestrator.generate(make_request(name, f"pd-{name}"))))
    assert_matches(tokens, reference[name])
    assert result.finish_reason == "length" and result.completion_tokens == MAX_TOKENS
    assert result.prompt_tokens == len(PROMPTS[name])
    t = result.timings
    assert t.ttft_s >= t.prefill_s > 0 and t.transfer_s > 0
    # The first token left with prefill's result, before the transfer and decode's step.
    assert t.ttft_s < t.queue_s + t.prefill_s + t.transfer_s
    assert_no_blocks_held(dep)


def test_with_stop_strings_decode_computes_the_first_token(deployment, reference):
    """A stop string could span the first token and the next: such requests keep vLLM's
    split (prefill stops one prompt token short, decode computes it), with the same output."""
    dep, orchestrator = deployment
    request = make_request("over_one_block", "pd-stop", stop=UNMATCHED_STOP)
    result = run(_prefill(dep.prefill.members[0].actor, request))
    assert result.first is None and result.handle.num_tokens == len(request.prompt_token_ids) - 1
    ray_get(dep.decode.members[0].actor.release_transfer.remote(result.handle))
    tokens, final = run(collect(orchestrator.generate(request)))
    assert_matches(tokens, reference["over_one_block"])
    t = final.timings  # the first token came after the transfer and decode's step
    assert t.ttft_s == pytest.approx(t.queue_s + t.prefill_s + t.transfer_s) and t.transfer_s > 0
    assert_no_blocks_held(dep)


def test_a_first_token_that_ends_the_request_is_never_decoded(deployment, reference):
    """max_tokens=1, or a stop token sampled by prefill: no decode leg, and the producer's
    blocks are released at once, not at lease expiry."""
    dep, orchestrator = deployment
    first = reference["long"].tokens[0]
    for sampling in (
        SamplingConfig(max_tokens=1, ignore_eos=True),
        SamplingConfig(max_tokens=MAX_TOKENS, stop_token_ids=(first,)),
    ):
        request = GenerateRequest("pd-one", PROMPTS["long"], sampling)
        tokens, result = run(collect(orchestrator.generate(request)))
        assert tokens == [first]
        assert result.finish_reason == ("length" if sampling.max_tokens == 1 else "stop")
        assert result.decode_worker == "" and result.prefill_worker == "prefill-0"
        assert result.timings.transfer_bytes.total == 0 and result.timings.transfer_s == 0
        assert_no_blocks_held(dep, timeout_s=4)  # well inside the 30 s lease


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


@pytest.mark.parametrize("stop", [(), UNMATCHED_STOP], ids=["first-token-from-prefill", "first-token-from-decode"])
def test_decode_continues_the_transferred_state_not_its_own_prompt(deployment, reference, stop):
    """Decode is asked for X but handed Y's KV blocks and DeltaNet state: if the state
    really moved, it continues Y, which differs from X's own output. (Y ends on X's last
    token: decode's own input is X's, plus Y's first token where prefill sampled it.)"""
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    y_result = run(_prefill(prefill, make_request("y", "swap-y", stop=stop)))
    assert (y_result.first is None) == bool(stop)
    tokens = run(decode_after(decode, y_result, make_request("x", "swap-x", stop=stop)))
    assert reference["x"].decisive[:MIN_COMPARED] != reference["y"].decisive[:MIN_COMPARED]
    assert_matches(tokens, reference["y"])
    assert_no_blocks_held(dep)


def test_decode_refuses_a_prompt_that_does_not_fit_the_handle(deployment):
    """The prompt alone on a handle that holds it all would feed the last prompt token twice."""
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    request = make_request("short", "misfit")
    result = run(_prefill(prefill, request))
    assert result.first is not None and result.handle.num_tokens == len(request.prompt_token_ids)
    with pytest.raises(InvalidRequestError, match="decode_leg"):
        run(decode_tokens(decode, request, result.handle))
    ray_get(decode.release_transfer.remote(result.handle))
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
    # Gated DeltaNet: conv state (kernel-1) x conv channels in bf16 + the temporal state, in the
    # dtype vLLM keeps it in on this CPU (float32 with AVX512-BF16, else bf16).
    state_bytes = DTYPE_BYTES[ssm_state_dtype("cpu", "bfloat16")]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2
    heads = config["linear_num_value_heads"]
    temporal = heads * config["linear_key_head_dim"] * config["linear_value_head_dim"] * state_bytes
    layout = ray_get(prefill.state_layout.remote())
    block = next(g.block_size for g in layout.groups if g.block_size)

    seen = []
    for name in ["short", "over_one_block", "long"]:
        handle = run(_prefill(prefill, make_request(name, f"bytes-{name}"))).handle
        # Prefill computed the whole prompt (it sampled the first token); whole blocks move.
        assert handle.num_tokens == len(PROMPTS[name])
        assert handle.bytes.attention_kv == math.ceil(handle.num_tokens / block) * block * attn_per_token
        assert handle.bytes.deltanet_state == n_gdn * (conv + temporal)
        seen.append(handle.bytes)
        # Never decoded: released as a router releases a cancelled request's.
        ray_get(dep.decode.members[0].actor.release_transfer.remote(handle))
    assert seen[0].attention_kv < seen[1].attention_kv < seen[2].attention_kv
    assert len({b.deltanet_state for b in seen}) == 1
    assert_no_blocks_held(dep)


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
    result = run(_prefill(prefill, make_request("short", "ghost-src")))
    handle = result.handle
    ghost = dataclasses.replace(
        handle,
        engine_id="prefill-ghost",
        port=1,
        connector_params={**handle.connector_params, "remote_engine_id": "prefill-ghost", "remote_port": 1},
    )
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_after(decode, dataclasses.replace(result, handle=ghost), make_request("short", "ghost-dst")))
    ray_get(decode.release_transfer.remote(handle))  # as a router releases a failed request's
    assert_no_blocks_held(dep)


SHADOW_STEPS = 16


def test_a_shadow_check_agrees_with_a_true_handoff_and_catches_wrong_state(deployment, reference):
    """Issue 32's shadow verification on real engines: the router recomputes a served request
    colocated and agrees; a request decoded on another request's state (a stale handle) and
    one whose DeltaNet state slots were corrupted on the producer both diverge."""
    dep, orchestrator = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    previous, orchestrator.shadow = orchestrator.shadow, ShadowVerifier(1.0, SHADOW_STEPS)  # --verify-fraction 1

    async def served() -> list:
        events = [event async for event in orchestrator.generate(make_request("long", "shadow-true"))]
        await orchestrator.shadow.settled()
        return events

    try:
        events = run(served())
    finally:
        verifier, orchestrator.shadow = orchestrator.shadow, previous
    assert_matches([t for chunk in events[:-1] for t in chunk.token_ids], reference["long"])
    assert not any(chunk.logprobs for chunk in events[:-1]), "the client asked for no logprobs"
    (verdict,) = verifier.verdicts
    assert verdict.agrees and verdict.steps == SHADOW_STEPS, verdict
    assert (verdict.prefill, verdict.decode) == ("prefill-0", "decode-0")

    # A stale handle: X decoded on Y's state.
    y_result = run(_prefill(prefill, make_request("y", "shadow-y", logprobs=0)))
    x = make_request("x", "shadow-x", logprobs=0)
    tokens, served_logprobs = run(decode_on_handle(decode, y_result, x))
    stale = run(verify(decode, x, tokens[:SHADOW_STEPS], served_logprobs[:SHADOW_STEPS], "prefill-0", "decode-0"))

    # Noise over the request's DeltaNet state slots on the producer, before decode reads them,
    # on a handoff not sampled for digests (which would refuse it: the test below). A salt of
    # its own keeps the corrupted blocks out of every other request's prefix hits.
    corrupt = dataclasses.replace(make_request("x", "shadow-corrupt", logprobs=0), cache_salt="corrupted")
    result = without_digests(run(_prefill(prefill, corrupt)))
    layout = ray_get(prefill.state_layout.remote())
    changed = tamper_state(prefill, state_slots(layout, result.handle), "noise")
    assert changed == [2 * sum(g.num_layers for g in layout.groups if g.kind is GroupKind.DELTANET)]
    tokens, served_logprobs = run(decode_on_handle(decode, result, corrupt))
    broken = run(
        verify(decode, corrupt, tokens[:SHADOW_STEPS], served_logprobs[:SHADOW_STEPS], "prefill-0", "decode-0")
    )
    print("shadow verdicts:", verdict, stale, broken, sep="\n")
    assert not stale.agrees and not broken.agrees
    assert_no_blocks_held(dep)


def test_transfer_digests_catch_a_flipped_bit_a_shifted_block_table_and_a_missing_conv_state(deployment, reference):
    """Issue 32's transfer digests: prefill's engine digests every block and state slot it
    holds for decode, and decode's checks what its READ brought before the request runs. Each
    fault below, made on the producer after its digests (or in the handle), fails the load
    (this deployment's policy: fail, so the router would migrate the request; with
    "recompute" decode recomputes it: tests/test_faults.py) and is counted by kind."""
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    layout = ray_get(prefill.state_layout.remote())
    failures = lambda: engine_counter(decode, "pdserve_handoff_integrity_failures", "kind")  # noqa: E731
    checks = lambda: engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")  # noqa: E731
    before, checks_before = failures(), checks()

    def handoff(name: str):
        request = dataclasses.replace(make_request("x", f"digest-{name}"), cache_salt=f"tampered-{name}")
        result = run(_prefill(prefill, request))
        assert DIGESTS_KEY in result.handle.connector_params  # every handoff (digest_fraction 1)
        return request, result

    request, result = handoff("flip")
    assert tamper_state(prefill, state_slots(layout, result.handle), "flip_a_byte") == [1]
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_after(decode, result, request))

    request, result = handoff("zero-conv")
    tamper_state(prefill, state_slots(layout, result.handle), "zero_conv")
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_after(decode, result, request))

    request, result = handoff("shift")
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_after(decode, attention_blocks_shifted(result, layout), request))

    after, checks_after = failures(), checks()
    failed = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in ("attention", "state")}
    assert failed == {"attention": 1, "state": 2}, failed
    checked = {o: checks_after.get(o, 0) - checks_before.get(o, 0) for o in ("checked", "unchecked")}
    assert checked == {"checked": 3, "unchecked": 0}, checked

    # And an untouched handoff passes its check and decodes.
    request, result = handoff("untouched")
    assert_matches(run(decode_after(decode, result, request)), reference["x"])
    assert checks().get("checked", 0) - checks_before.get("checked", 0) == 4 and failures() == after
    assert_no_blocks_held(dep)


def test_a_request_whose_handoff_fails_its_digests_is_prefilled_again_with_the_right_tokens(deployment, reference):
    """Through the router under this deployment's load policy (fail): a bit flipped in the
    first handoff's state on the producer, after its digests; decode refuses the load, the
    router prefills the request again (--transfer-retries) and the client gets the reference
    tokens, once each."""
    from router import metrics

    dep, orchestrator = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    layout = ray_get(prefill.state_layout.remote())
    failures = engine_counter(decode, "pdserve_handoff_integrity_failures", "kind").get("state", 0)
    retries = metrics.HANDOFF_RETRIES._value.get()
    real, tampered = orchestrator._prefill_or_local, []

    async def tampering_with_the_first(leg):  # the fault, at the moment it would happen
        member, result, plan = await real(leg)
        if not tampered:
            tampered.append(tamper_state(prefill, state_slots(layout, result.handle), "flip_a_byte"))
        return member, result, plan

    orchestrator._prefill_or_local = tampering_with_the_first
    request = dataclasses.replace(make_request("x", "digest-retry"), cache_salt="tampered-retry")
    try:
        tokens, result = run(collect(orchestrator.generate(request)))
    finally:
        del orchestrator._prefill_or_local
    assert tampered == [[1]]
    assert_matches(tokens, reference["x"])
    assert result.completion_tokens == MAX_TOKENS and result.migrations == 0
    assert engine_counter(decode, "pdserve_handoff_integrity_failures", "kind").get("state", 0) == failures + 1
    assert metrics.HANDOFF_RETRIES._value.get() == retries + 1
    assert_no_blocks_held(dep)
