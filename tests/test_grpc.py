"""The product as users see it: gRPC streaming from a real local Ray cluster with real
vLLM engines and NIXL transfer behind the router."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import ServedStack, assert_no_blocks_held, stream_tokens
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from reference import MAX_TOKENS, PROMPTS, assert_matches

from router.client import build_request, stream_generate


@pytest.fixture(scope="module")
def stack(shared_deployment, reference, model_path):
    """The session's 1P+1D behind a router of this module's."""
    served = ServedStack(shared_deployment, model_path)
    yield served
    served.close()


def _call(stack, coro_fn):
    return stack.call(coro_fn)


_stream = stream_tokens


def _ids(name):
    return list(PROMPTS[name])


def test_streamed_generation_equals_colocated_reference(stack, reference):
    request = build_request(_ids("over_one_block"), "grpc-1", max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens, text, final = _call(stack, lambda ch: _stream(ch, request))
    assert_matches(tokens, reference["over_one_block"])
    assert text  # detokenized deltas arrive with the ids
    assert final.request_id == "grpc-1" and final.finish_reason == "length"
    assert final.usage.prompt_tokens == len(PROMPTS["over_one_block"]) and final.usage.completion_tokens == MAX_TOKENS
    t = final.timings
    assert 0 < t.prefill_s < t.ttft_s < t.e2e_s and t.inter_token.p50_s > 0
    assert t.attention_kv_bytes > 0 and t.deltanet_state_bytes > 0


def test_tokens_stream_as_produced_not_buffered(stack):
    request = build_request(_ids("short"), "grpc-stream", max_tokens=40, ignore_eos=True)

    async def arrival_times(channel):
        start, times = time.perf_counter(), []
        async for response in stream_generate(channel, request):
            if response.HasField("chunk"):
                times.append(time.perf_counter())
        return start, times

    start, times = _call(stack, arrival_times)
    assert len(times) >= 20  # about one message per engine step
    # Buffered output would arrive in one burst at the end; streamed output is spread out.
    assert times[-1] - times[0] > 0.3 * (times[-1] - start)


def test_text_prompt_is_tokenized_by_the_router(stack):
    request = build_request("Prefill and decode are two different machines.", max_tokens=4)
    tokens, _, final = _call(stack, lambda ch: _stream(ch, request))
    assert len(tokens) == final.usage.completion_tokens <= 4 and final.usage.prompt_tokens > 5


def test_eight_concurrent_streams_complete_correctly(stack, reference):
    dep = stack.dep
    names = ["short", "over_one_block", "long", "x", "y", "y", "short", "x"]

    async def all_streams(channel):
        return await asyncio.gather(
            *(
                _stream(channel, build_request(_ids(n), f"c8-{i}", max_tokens=MAX_TOKENS, ignore_eos=True))
                for i, n in enumerate(names)
            )
        )

    results = _call(stack, all_streams)
    for name, (tokens, _, final) in zip(names, results):
        assert_matches(tokens, reference[name])
        assert final.finish_reason == "length"
    assert_no_blocks_held(dep)


def test_client_cancel_mid_stream_frees_blocks_on_both_engines(stack):
    dep = stack.dep
    request = build_request(_ids("long"), "cancel-me", max_tokens=2000, ignore_eos=True)

    async def cancel_after_tokens(channel):
        stub_stream = stream_generate(channel, request)
        received = 0
        async for response in stub_stream:
            received += len(response.chunk.token_ids)
            if received >= 5:
                break
        await stub_stream.aclose()  # closes the call: the client cancels the RPC
        return received

    assert _call(stack, cancel_after_tokens) >= 5
    assert_no_blocks_held(dep, timeout_s=10)


def test_deadline_shorter_than_generation(stack):
    dep = stack.dep
    request = build_request(_ids("long"), "deadline", max_tokens=3000, ignore_eos=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _call(stack, lambda ch: _stream(ch, request, timeout_s=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_blocks_held(dep, timeout_s=10)


@pytest.mark.parametrize(
    ("sampling", "prompt", "field"),
    [
        ({"max_tokens": -1}, "short", "max_tokens"),
        ({"max_tokens": 0}, "short", "max_tokens"),
        ({"temperature": -0.5}, "short", "temperature"),
        ({"top_p": 0.0}, "short", "top_p"),
        ({"top_p": 1.01}, "short", "top_p"),
        ({"stop_token_ids": [999999]}, "short", "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "short", "stop_token_ids"),
        ({}, "too_long", "prompt"),
        ({}, "empty", "prompt"),
        ({}, "one_token", "prompt"),
    ],
)
def test_invalid_parameters_are_invalid_argument_naming_the_field(stack, sampling, prompt, field):
    special = {"too_long": [5] * 9000, "empty": [], "one_token": [7]}
    ids = special[prompt] if prompt in special else _ids(prompt)
    request = build_request(ids, **sampling)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _call(stack, lambda ch: _stream(ch, request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert_no_blocks_held(stack.dep)


def test_very_short_prompt_is_prefilled_on_the_decode_engine(stack):
    # Below the policy's threshold the router skips the prefill pool (no transfer at all).
    request = build_request([11, 12], max_tokens=4, ignore_eos=True)
    tokens, _, final = _call(stack, lambda ch: _stream(ch, request))
    assert len(tokens) == 4 and final.prefill_worker == ""
    assert final.timings.attention_kv_bytes == final.timings.deltanet_state_bytes == 0
    assert_no_blocks_held(stack.dep)


def _scrape(address: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_show_every_phase_and_the_transfer(stack):
    import ray
    from prometheus_client import REGISTRY

    request = build_request(_ids("long"), "metrics", max_tokens=8, ignore_eos=True)
    _call(stack, lambda ch: _stream(ch, request))
    bucket = {"prompt_bucket": "512-2047"}
    for name in ("ttft", "queue", "prefill", "transfer", "e2e", "inter_token"):
        assert REGISTRY.get_sample_value(f"pdserve_{name}_seconds_count", bucket) >= 1, name
    assert REGISTRY.get_sample_value("pdserve_actor_kv_blocks_total", {"role": "decode", "actor": "decode-0"}) > 0

    dep = stack.dep
    decode = _scrape(ray.get(dep.decode.members[0].actor.metrics_address.remote()))
    assert decode["pdserve_nixl_transfer_seconds_count[]"] >= 1
    assert decode["pdserve_nixl_transfer_bytes_sum[]"] > 0
    assert decode["pdserve_transfer_state_bytes_total[('kind', 'deltanet_state')]"] > 0
    assert decode["pdserve_engine_step_cpu_seconds_total[]"] > 0  # what serving costs beside it
    prefill = _scrape(ray.get(dep.prefill.members[0].actor.metrics_address.remote()))
    assert prefill["pdserve_leases_granted_total[]"] >= 1


def test_prometheus_target_file_lists_every_worker_endpoint(stack, tmp_path):
    """What `--prometheus-sd-file` keeps current: every target answers with worker metrics."""
    import json

    from cluster.prometheus_targets import write_targets

    dep = stack.dep
    path = tmp_path / "workers.json"
    assert write_targets(path, (dep.prefill, dep.decode)) and not write_targets(path, (dep.prefill, dep.decode))
    groups = json.loads(path.read_text())
    assert sorted((g["labels"]["role"], g["labels"]["actor"]) for g in groups) == [
        ("decode", "decode-0"),
        ("prefill", "prefill-0"),
    ]
    for group in groups:
        assert any(name.startswith("pdserve_leases_granted_total") for name in _scrape(group["targets"][0]))


def test_admin_scale_pools_keeps_the_serving_mode(stack):
    from proto.pdserve.v1 import generate_pb2 as pb
    from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc

    async def scale(channel, prefill, decode):
        return await pb_grpc.AdminStub(channel).ScalePools(pb.ScalePoolsRequest(prefill=prefill, decode=decode))

    sizes = _call(stack, lambda ch: scale(ch, 1, 1))  # already that size: a no-op
    assert (sizes.prefill, sizes.decode) == (1, 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _call(stack, lambda ch: scale(ch, 0, 1))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_tune_apply_resizes_the_pools_through_admin(stack):
    from planner.cli import _apply
    from planner.simulator import Split

    assert _apply(stack.server.address, Split(prefill=1, decode=1), tp=1) == 0
    assert _apply(stack.server.address, Split(prefill=0, decode=2), tp=1) == 1  # mode switch refused
    assert _apply(stack.server.address, Split(prefill=1, decode=1), tp=4) == 1  # a plan for TP-4 engines


def test_reflection_lists_the_services(stack):
    async def list_services(channel):
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for response in responses:
            return {s.name for s in response.list_services_response.service}

    services = _call(stack, list_services)
    assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= services
