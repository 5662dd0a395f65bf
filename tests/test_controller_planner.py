"""The closed-loop planner in the controller: reports from routers become interval
observations, a "change" decision resizes the pools. Fast tests with a stand-in resize on a
given clock, then the real loop: a controller actor with engines, a router actor, prefill-
heavy traffic through gRPC, and the split moving from 1P:2D to 2P:1D without a failed request."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from conftest import wait_until

from controller.planning import PlannerSetup, PlanningLoop
from messages.membership import RouterReport
from messages.timings import SLO, FinishedRequest
from planner.closed_loop import ClosedLoopPlanner, PlannerConfig
from planner.model import PerformanceModel

# The seeds' 27B model on 4xH100: a 2,000-token prompt takes 0.6 s of prefill, so one prefill
# instance serves ~1.6 req/s of such prompts while decode of 10 tokens is nearly free.
CONFIG = PlannerConfig(instances=3, slo=SLO(ttft_s=2.0, itl_s=0.1), interval_s=60, cooldown_s=0, min_requests=10)


def _report(start_s: float, rate: float, seconds: float, prompt: int, output: int) -> RouterReport:
    count = int(rate * seconds)
    finished = tuple(FinishedRequest(start_s + i / rate, prompt, output, 0.8, 0.02) for i in range(count))
    return RouterReport(finished, count)


class _Pools:
    def __init__(self, prefill: int, decode: int, fail: bool = False) -> None:
        self.split = (prefill, decode)
        self.fail = fail
        self.resizes: list[tuple[int, int]] = []

    async def resize(self, prefill: int, decode: int) -> tuple[int, int]:
        self.resizes.append((prefill, decode))
        if self.fail:
            raise RuntimeError("no node offered the bundle")
        self.split = (prefill, decode)
        return self.split


def _loop(pools: _Pools, now: list[float]) -> PlanningLoop:
    planner = ClosedLoopPlanner(CONFIG, PerformanceModel.seeds_example())
    return PlanningLoop(planner, lambda: pools.split, pools.resize, clock=lambda: now[0])


def test_prefill_heavy_traffic_moves_the_split_toward_prefill():
    pools, now = _Pools(1, 2), [0.0]
    loop = _loop(pools, now)
    loop.add(_report(0, rate=4.0, seconds=30, prompt=2000, output=10))  # two routers' reports
    loop.add(_report(30, rate=4.0, seconds=30, prompt=2000, output=10))
    now[0] = 60.0
    decision = asyncio.run(loop.step())
    assert decision.current.label == "1P:2D" and decision.changed and decision.recommended.prefill == 2
    assert pools.resizes == [(2, 1)] and pools.split == (2, 1)
    assert loop.changes[0].applied == (2, 1) and loop.changes[0].seconds >= 0
    assert decision.forecast_rate_rps == pytest.approx(4.0, rel=0.05)


def test_an_interval_without_enough_requests_holds():
    pools, now = _Pools(1, 2), [0.0]
    loop = _loop(pools, now)
    loop.add(_report(0, rate=0.1, seconds=60, prompt=2000, output=10))  # 6 requests
    now[0] = 60.0
    decision = asyncio.run(loop.step())
    assert not decision.changed and "fewer than 10" in decision.reason and pools.resizes == []


def test_a_change_that_cannot_be_made_is_recorded_and_seen_as_not_made():
    pools, now = _Pools(1, 2, fail=True), [0.0]
    loop = _loop(pools, now)
    loop.add(_report(0, rate=4.0, seconds=60, prompt=2000, output=10))
    now[0] = 60.0
    asyncio.run(loop.step())
    assert loop.changes[0].applied is None and pools.split == (1, 2)
    loop.add(_report(60, rate=4.0, seconds=60, prompt=2000, output=10))
    now[0] = 120.0
    second = asyncio.run(loop.step())
    assert second.current.label == "1P:2D"  # the next observation reads the running split back


@pytest.fixture(scope="module")
def planned(ray_cluster, engine_config, model_path, tmp_path_factory):
    """1P:2D under a controller whose planner decides every 4 s on the seeds' model."""
    from controller.actor import controller_for
    from controller.deployment import DeploymentConfig
    from router.actor import RouterActor, RouterSettings

    live = PlannerConfig(
        instances=3, slo=SLO(ttft_s=2.0, itl_s=0.1), interval_s=4.0, cooldown_s=0, min_requests=8, search_requests=100
    )
    config = DeploymentConfig(engine=engine_config, num_prefill=1, num_decode=2, drain_quiet_s=1.0)
    setup = PlannerSetup(live, PerformanceModel.seeds_example())
    controller, _ = controller_for(config, f"test-planner-{uuid.uuid4().hex[:6]}", planner=setup)
    ray_cluster.get(controller.start.remote())
    router = RouterActor.remote("router-p", controller, RouterSettings(model=model_path, health_interval_s=0.2))
    address = ray_cluster.get(router.serve.remote()).grpc
    yield controller, address
    ray_cluster.kill(router, no_restart=True)
    ray_cluster.get(controller.shutdown.remote())
    ray_cluster.kill(controller, no_restart=True)


def test_the_live_planner_moves_engines_to_prefill_without_failing_a_request(ray_cluster, planned):
    import grpc

    from router.client import build_request, stream_generate

    controller, address = planned
    prompt = [(7 * i) % 2000 + 1 for i in range(1500)]  # long prompts, short answers: prefill-bound

    async def traffic(stop: asyncio.Event) -> tuple[int, list[str]]:
        done, failures = 0, []
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(i: int) -> None:
                nonlocal done
                request = build_request(prompt, f"plan-{i}", max_tokens=4, ignore_eos=True)
                try:
                    async for _ in stream_generate(channel, request, timeout_s=120):
                        pass
                    done += 1
                except grpc.aio.AioRpcError as err:
                    failures.append(f"{err.code().name}: {err.details()}")

            tasks, i = [], 0
            while not stop.is_set():
                tasks.append(asyncio.ensure_future(one(i)))
                i += 1
                await asyncio.sleep(0.25)  # 4 req/s offered: more than one CPU prefill engine serves
            await asyncio.gather(*tasks)
        return done, failures

    async def scenario() -> tuple[int, list[str]]:
        stop = asyncio.Event()
        running = asyncio.ensure_future(traffic(stop))
        changed = False
        for _ in range(150):  # up to 150 s: start a prefill engine, handshake, drain a decode one
            await asyncio.sleep(1)
            view = await controller.view.remote()
            if len(view.prefill) == 2 and len(view.decode) == 1 and all(m.alive for m in view.prefill):
                changed = True
                break
        await asyncio.sleep(3)  # traffic on the new split
        stop.set()
        result = await running
        assert changed, "\n".join(await controller.planner_log.remote())
        return result

    done, failures = asyncio.run(scenario())
    log = ray_cluster.get(controller.planner_log.remote())
    print("\n".join(log))
    assert failures == [] and done > 0
    assert any("change 1P:2D -> 2P:1D" in line for line in log)
    assert any(line.startswith("planner split change 1P:2D -> 2P:1D took") for line in log)
    assert wait_until(lambda: len(ray_cluster.get(controller.view.remote()).decode) == 1, timeout_s=10)
