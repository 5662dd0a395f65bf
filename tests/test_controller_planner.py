"""The closed-loop planner in the controller: reports from routers become interval
observations, a "change" decision resizes the pools. Fast tests with a stand-in resize on a
given clock; the live loop (engines, routers, gRPC traffic, a real split change) runs last
in tests/test_routers.py, on that module's controller."""

from __future__ import annotations

import asyncio

import pytest

from controller.planning import PlanningLoop
from messages.membership import RouterReport, ScalingDecision, ScalingOutcome
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
        self.resizes: list[ScalingDecision] = []

    async def resize(self, decision: ScalingDecision) -> ScalingOutcome:
        self.resizes.append(decision)
        if self.fail:
            raise RuntimeError("no node offered the bundle")
        before, self.split = self.split, (decision.prefill, decision.decode)
        return ScalingOutcome(decision, before, self.split)


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
    assert [(d.prefill, d.decode) for d in pools.resizes] == [(2, 1)] and pools.split == (2, 1)
    assert pools.resizes[0].reason == f"planner: {decision.reason}"  # why, as the planner said it
    assert loop.changes[0].applied == (2, 1) and loop.changes[0].seconds >= 0
    assert decision.forecast_rate_rps == pytest.approx(4.0, rel=0.05)


def test_an_interval_without_enough_requests_holds():
    pools, now = _Pools(1, 2), [0.0]
    loop = _loop(pools, now)
    loop.add(_report(0, rate=0.1, seconds=60, prompt=2000, output=10))  # 6 requests
    now[0] = 60.0
    decision = asyncio.run(loop.step())
    assert not decision.changed and "fewer than 10" in decision.reason and pools.resizes == []


def test_an_overloaded_interval_is_acted_on_by_its_arrivals():
    """Prefill falls behind: 4 req/s of 2,000-token prompts arrive, 6 requests finish. With
    the length mix known from the interval before, the arrivals alone move the split."""
    pools, now = _Pools(1, 2), [0.0]
    loop = _loop(pools, now)
    loop.add(_report(0, rate=0.2, seconds=60, prompt=2000, output=10))  # 12 finished: the mix
    now[0] = 60.0
    first = asyncio.run(loop.step())
    assert not first.changed
    finished = _report(60, rate=0.1, seconds=60, prompt=2000, output=10).finished  # 6 finished
    loop.add(RouterReport(finished, 240))
    now[0] = 120.0
    decision = asyncio.run(loop.step())
    assert decision.changed and decision.recommended.prefill == 2, decision.reason
    assert pools.split == (2, 1)


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


def test_a_budget_above_the_running_engines_grows_the_pool_that_needs_it():
    """--gpu-budget 5 over 1P:2D: traffic that one prefill engine cannot carry grows the
    prefill pool within the budget (the new engines' split groups are what Ray's
    autoscaler answers with nodes: tests/test_deploy_loopback.py)."""
    from dataclasses import replace

    pools, now = _Pools(1, 2), [0.0]
    planner = ClosedLoopPlanner(replace(CONFIG, instances=5), PerformanceModel.seeds_example())
    loop = PlanningLoop(planner, lambda: pools.split, pools.resize, clock=lambda: now[0])
    loop.add(_report(0, rate=4.0, seconds=60, prompt=2000, output=10))
    now[0] = 60.0
    decision = asyncio.run(loop.step())
    assert decision.changed and decision.current.label == "1P:2D"
    (asked,) = pools.resizes
    prefill, decode = asked.prefill, asked.decode
    assert prefill + decode == 5 and prefill > 1, pools.resizes
