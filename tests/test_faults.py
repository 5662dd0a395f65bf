"""Failures with real processes and real kills (SIGKILL of an actor's process), then a soak
of 60 requests through them."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import time

import grpc
import pytest
import ray
from conftest import (
    ServedStack,
    answers,
    assert_no_blocks_held,
    engine_pid,
    run,
    sigkill,
    stream_tokens,
    wait_until,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from injection import state_slots, tamper_state
from reference import MAX_TOKENS, PROMPTS, assert_matches, collect, decode_after, make_request

from kv_transfer.connector_config import TransferConfig
from messages.errors import DecodeFailedError, HandleExpiredError, NoWorkerError, TransferFailedError
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from controller.deployment import Deployment, DeploymentConfig
from router.client import build_request
from router.orchestrator import RouterPolicy


FAIL_LEASE_S = 10
SOAK_REQUESTS = 40
SOAK_CONCURRENCY = 12
CLEAN_ERRORS = (DecodeFailedError, NoWorkerError, TransferFailedError)


def _up(engine_config, **kwargs) -> tuple[Deployment, object]:
    dep = Deployment(DeploymentConfig(engine=engine_config, **kwargs))
    return dep, run(dep.start())


@pytest.fixture(scope="module")
def fail_policy(ray_cluster, engine_config, reference):
    # TCP only, as between hosts: a READ then needs the producer's process to make progress.
    transfer = TransferConfig(
        lease_s=FAIL_LEASE_S, load_failure_policy="fail", ucx_transports="tcp", transfer_timeout_s=5
    )
    dep, orchestrator = _up(engine_config, transfer=transfer)
    yield dep, orchestrator
    dep.shutdown()


def test_prefill_killed_before_decode_pulls_fails_fast(fail_policy):
    dep, _ = fail_policy
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    result = ray.get(prefill.prefill.remote(make_request("long", "orphan")))
    sigkill(prefill)
    started = time.monotonic()
    with pytest.raises(TransferFailedError, match="could not load"):
        run(decode_after(decode, result, make_request("long", "orphan")))
    assert time.monotonic() - started < 15, "decode must fail fast, not wait out a long timeout"


def test_restarted_prefill_actor_serves_again(fail_policy, reference):
    """Ray restarts the killed actor: a new engine under a new NIXL identity, handshaken anew."""
    dep, orchestrator = fail_policy
    prefill = dep.prefill.members[0].actor
    assert wait_until(lambda: answers(prefill), timeout_s=60)
    before = dict(dep.health.handshakes)
    run(dep.health.refresh(poll_timeout_s=5))
    assert dep.health.handshakes[("prefill-0", "decode-0")] != before[("prefill-0", "decode-0")]  # re-handshaken
    tokens, result = run(collect(orchestrator.generate(make_request("over_one_block", "after-restart"))))
    assert_matches(tokens, reference["over_one_block"])
    assert_no_blocks_held(dep, timeout_s=15)


def test_transfer_from_a_stalled_peer_times_out(fail_policy, reference):
    dep, orchestrator = fail_policy
    tokens, _ = run(collect(orchestrator.generate(make_request("short", "tcp-warm"))))  # handshake done
    assert_matches(tokens, reference["short"])
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    result = ray.get(prefill.prefill.remote(make_request("long", "stalled")))
    pid = engine_pid(prefill)
    os.kill(pid, signal.SIGSTOP)  # alive but not making progress
    try:
        started = time.monotonic()
        with pytest.raises(TransferFailedError, match="within 5s"):
            run(decode_after(decode, result, make_request("long", "stalled")))
        assert time.monotonic() - started < 15
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_no_blocks_held(dep, timeout_s=20)  # decode aborted it; the producer's lease ran out


def test_expired_handle_is_refused_and_lease_frees_blocks(fail_policy):
    dep, _ = fail_policy
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    result = ray.get(prefill.prefill.remote(make_request("long", "expire-src")))
    load = ray.get(prefill.load.remote())
    assert load.held_for_transfer == 1 and load.free_blocks < load.total_blocks
    assert_no_blocks_held(dep, timeout_s=FAIL_LEASE_S + 10)  # the lease ran out
    with pytest.raises(HandleExpiredError, match="expired"):
        run(decode_after(decode, result, make_request("long", "expire-dst")))
    assert_no_blocks_held(dep)


def test_health_not_serving_without_a_live_decode_actor(fail_policy, model_path):
    """The last on this deployment: it kills the decode actor for good. (Without prefill
    actors the service stays SERVING, degraded: decode engines prefill; test_front_door
    covers it.)"""
    dep, _ = fail_policy
    stack = ServedStack(dep, model_path)
    try:

        def status():
            async def check(channel):
                stub = health_pb2_grpc.HealthStub(channel)
                return (await stub.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"))).status

            return stack.call(check)

        assert status() == health_pb2.HealthCheckResponse.SERVING
        ray.kill(dep.decode.members[0].actor, no_restart=True)

        assert wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout_s=15)
        request = build_request(list(PROMPTS["short"]), max_tokens=4)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            stack.call(lambda ch: stream_tokens(ch, request))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.close()


@pytest.fixture(scope="module")
def recompute_policy(ray_cluster, engine_config, reference, fail_policy):
    fail_policy[0].shutdown()  # at most a few engines on this box at once
    dep, orchestrator = _up(
        engine_config,
        transfer=TransferConfig(lease_s=10, load_failure_policy="recompute"),
        num_decode=2,
        policy=RouterPolicy(on_decode_failure="migrate"),
    )
    yield dep, orchestrator
    dep.shutdown()


def test_prefill_killed_recompute_policy_prefills_on_decode(recompute_policy, reference):
    dep, _ = recompute_policy
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    result = ray.get(prefill.prefill.remote(make_request("x", "recompute")))
    sigkill(prefill)
    tokens = run(decode_after(decode, result, make_request("x", "recompute")))
    assert_matches(tokens, reference["x"])
    wait_until(lambda: answers(prefill), timeout_s=60)


def test_decode_killed_mid_stream_migrates_to_another_decode_actor(recompute_policy, reference):
    dep, orchestrator = recompute_policy
    assert wait_until(lambda: answers(dep.prefill.members[0].actor), timeout_s=60)
    run(dep.health.refresh(poll_timeout_s=5))

    async def stream_and_kill():
        tokens, result, killed = [], None, None
        async for event in orchestrator.generate(make_request("long", "migrate-me")):
            if hasattr(event, "token_ids"):
                tokens.extend(event.token_ids)
                if killed is None and len(tokens) >= 5:
                    killed = next(m for m in dep.decode.members if m.outstanding_requests)
                    sigkill(killed.actor)
            else:
                result = event
        return tokens, result, killed

    tokens, result, killed = run(stream_and_kill())
    assert result.migrations == 1 and result.decode_worker != killed.name
    assert result.completion_tokens == MAX_TOKENS == len(tokens)
    assert_matches(tokens, reference["long"])  # one uninterrupted, correct stream
    assert wait_until(lambda: answers(killed.actor), timeout_s=60)  # Ray restarted it
    assert_no_blocks_held(dep, timeout_s=15)


def test_a_handoff_whose_digest_fails_is_recomputed_on_decode(recompute_policy, reference):
    """A bit flipped in a state slot on the producer after its digests: decode's check
    refuses the pulled state and, under this deployment's policy, vLLM recomputes the request
    on decode: the client gets the right tokens."""
    dep, _ = recompute_policy
    assert wait_until(lambda: answers(dep.prefill.members[0].actor), timeout_s=60)
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    request = dataclasses.replace(make_request("x", "digest-recompute"), cache_salt="tampered-recompute")
    result = ray.get(prefill.prefill.remote(request))
    layout = ray.get(prefill.state_layout.remote())
    assert tamper_state(prefill, state_slots(layout, result.handle), "flip_a_byte") == [1]
    tokens = run(decode_after(decode, result, request))
    assert_matches(tokens, reference["x"])
    assert_no_blocks_held(dep, timeout_s=15)


@pytest.mark.slow
def test_soak_with_cancellations_and_a_kill(recompute_policy):
    """Last: 40 requests (random lengths, a quarter cancelled by their client) with a decode
    actor killed mid-run, bounded in count and time. Afterwards no engine holds a block and
    every stream ended with its tokens or a clean error."""
    dep, orchestrator = recompute_policy
    # The module's kills restarted engines, and a deployment without a router polls no health
    # on its own: every engine answers and is handshaken again before the load.
    assert wait_until(lambda: all(answers(m.actor) for m in dep.prefill.members + dep.decode.members), 90)
    run(dep.health.refresh(poll_timeout_s=5))
    assert all(m.live for m in dep.prefill.members + dep.decode.members)
    rng = random.Random(7)
    outcomes: dict[str, int] = {"completed": 0, "cancelled": 0, "clean_error": 0}
    slots = asyncio.Semaphore(SOAK_CONCURRENCY)

    async def one(i: int) -> None:
        length = rng.randint(20, 400)
        max_tokens = rng.randint(4, 16)
        request = GenerateRequest(
            f"soak-{i}",
            tuple(rng.randint(1, 2000) for _ in range(length)),
            SamplingConfig(max_tokens=max_tokens, ignore_eos=True),
        )
        cancel_after = rng.uniform(0.01, 0.3) if rng.random() < 0.25 else None
        async with slots:
            task = asyncio.ensure_future(_consume(orchestrator, request))
            try:
                result = await asyncio.wait_for(asyncio.shield(task), cancel_after) if cancel_after else await task
            except asyncio.TimeoutError:
                task.cancel()  # the client goes away mid-request
                await asyncio.gather(task, return_exceptions=True)
                outcomes["cancelled"] += 1
                return
            except CLEAN_ERRORS:
                outcomes["clean_error"] += 1
                return
        assert result.completion_tokens == max_tokens and result.finish_reason == "length"
        outcomes["completed"] += 1

    async def kill_one_decode_actor() -> None:
        await asyncio.sleep(5)
        victim = dep.decode.members[0].actor
        pid = await victim.pid.remote()
        os.kill(pid, signal.SIGKILL)

    async def soak() -> None:
        await asyncio.gather(kill_one_decode_actor(), *(one(i) for i in range(SOAK_REQUESTS)))

    run(asyncio.wait_for(soak(), timeout=600))  # nothing may hang
    assert sum(outcomes.values()) == SOAK_REQUESTS
    assert outcomes["completed"] >= SOAK_REQUESTS // 2, outcomes
    assert outcomes["cancelled"] > 0, outcomes
    # The killed actor comes back (Ray restart); then nothing is held anywhere.
    assert wait_until(lambda: all(answers(m.actor) for m in dep.prefill.members + dep.decode.members), 90)
    assert_no_blocks_held(dep, timeout_s=30)
    print(f"soak outcomes: {outcomes}")


async def _consume(orchestrator, request) -> GenerationResult:
    result = None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
    return result
