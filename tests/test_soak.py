"""Soak: 100 requests with random client cancellations and one actor killed mid-run.
Bounded in count and time, loopback only. Afterwards no engine holds a block and every
stream ended with its tokens or a clean error."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest
import ray
from conftest import assert_no_blocks_held, run, wait_until

from kv_transfer.connector_config import TransferConfig
from messages.errors import DecodeFailedError, NoWorkerError, TransferFailedError
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from controller.deployment import Deployment, DeploymentConfig

NUM_REQUESTS = 100
CONCURRENCY = 12
CLEAN_ERRORS = (DecodeFailedError, NoWorkerError, TransferFailedError)


@pytest.fixture(scope="module")
def soak_deployment(ray_cluster, engine_config):
    dep = Deployment(
        DeploymentConfig(engine=engine_config, transfer=TransferConfig(lease_s=10), num_prefill=1, num_decode=2)
    )
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


@pytest.mark.slow
def test_soak_with_cancellations_and_a_kill(soak_deployment):
    dep, orchestrator = soak_deployment
    rng = random.Random(7)
    outcomes: dict[str, int] = {"completed": 0, "cancelled": 0, "clean_error": 0}
    slots = asyncio.Semaphore(CONCURRENCY)

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
        await asyncio.sleep(8)
        victim = dep.decode.members[0].actor
        pid = await victim.pid.remote()
        os.kill(pid, signal.SIGKILL)

    async def soak() -> None:
        await asyncio.gather(kill_one_decode_actor(), *(one(i) for i in range(NUM_REQUESTS)))

    run(asyncio.wait_for(soak(), timeout=600))  # nothing may hang
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert outcomes["completed"] >= NUM_REQUESTS // 2, outcomes
    assert outcomes["cancelled"] > 0, outcomes
    # The killed actor comes back (Ray restart); then nothing is held anywhere.
    assert wait_until(lambda: _all_answer(dep), timeout_s=90)
    assert_no_blocks_held(dep, timeout_s=30)
    print(f"soak outcomes: {outcomes}")


async def _consume(orchestrator, request) -> GenerationResult:
    result = None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
    return result


def _all_answer(dep) -> bool:
    try:
        ray.get([m.actor.ready.remote() for m in dep.prefill.members + dep.decode.members], timeout=5)
        return True
    except Exception:
        return False
