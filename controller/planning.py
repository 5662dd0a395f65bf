"""The closed loop in the controller: the routers' reports become one observation per
interval, the planner (planner/closed_loop.py) decides, and a change resizes the pools
(new engines are handshaken before traffic, leaving ones drain first). Every decision is
logged by the planner and exported here as metrics, with how long each change took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable

from prometheus_client import Counter, Gauge, Histogram

from configuration.fields import default_of, knob
from messages.membership import RouterReport, ScalingDecision, ScalingOutcome
from messages.timings import SLO, FinishedRequest
from planner.closed_loop import ClosedLoopPlanner, Decision, PlannerConfig
from planner.model import PerformanceModel
from planner.observe import IntervalObservation

if TYPE_CHECKING:
    from vllm_engine.config import EngineConfig

log = logging.getLogger(__name__)

SPLIT = Gauge("pdserve_planner_instances", "Engines per pool: running and recommended", ["pool", "split"])
GOODPUT = Gauge("pdserve_planner_predicted_goodput_rps", "Predicted goodput for the forecast", ["split"])
TTFT_P90 = Gauge("pdserve_planner_ttft_p90_seconds", "Last interval's TTFT p90", ["source"])
ITL_P90 = Gauge("pdserve_planner_itl_p90_seconds", "Last interval's ITL p90", ["source"])
FORECAST = Gauge("pdserve_planner_forecast_rate_rps", "Forecast arrival rate of the next interval")
CORRECTION = Gauge("pdserve_planner_correction", "Factor on the model's time per phase", ["phase"])
DECISIONS = Counter("pdserve_planner_decisions_total", "Planner decisions by action", ["action"])
CHANGE_SECONDS = Histogram(
    "pdserve_planner_split_change_seconds",
    "Time to apply a new split (start, handshake, drain)",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)


@dataclass(frozen=True, slots=True)
class PlannerSetup:
    """`pdserve serve --planner`: the planner's settings and the performance model fitted on
    this hardware (`pdserve probe`, then `pdserve tune --save-model`)."""

    config: PlannerConfig
    model: PerformanceModel


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """`pdserve serve --planner`'s flags; everything else of the planner keeps PlannerConfig's defaults."""

    enabled: bool = knob(False, flag="planner", help="re-plan the prefill:decode split every --interval")
    model: str | None = knob(
        None, flag="planner-model", help="performance model fitted on this hardware (`pdserve tune --save-model`)"
    )
    gpu_budget: int | None = knob(
        None, help="GPUs (CPU: engine core sets) the split may use (unset: the engines started)"
    )
    interval_s: float = knob(
        default_of(PlannerConfig, "interval_s"), flag="interval", help="seconds between two decisions"
    )
    cooldown_s: float = knob(
        default_of(PlannerConfig, "cooldown_s"), flag="cooldown", help="least seconds between two split changes"
    )
    hysteresis: float = knob(default_of(PlannerConfig, "hysteresis"), help="least relative goodput gain worth a change")
    ttft_slo_s: float = knob(2.0, flag="ttft-slo", help="time to first token, seconds, for 90% of requests")
    itl_slo_s: float = knob(0.1, flag="itl-slo", help="a request's mean inter-token seconds, for 90% of requests")

    def setup(self, prefill: "EngineConfig", decode: "EngineConfig", engines: int) -> PlannerSetup | None:
        """The planner for pools of these engines (`engines` started); None when it is off."""
        if not self.enabled:
            return None
        if not self.model:
            raise ValueError(
                "--planner needs --planner-model: fit one on this hardware with `pdserve probe --out probe.json` "
                "and `pdserve tune --probe probe.json --save-model model.json`"
            )
        per_engine = max(prefill.tensor_parallel_size, decode.tensor_parallel_size)
        config = PlannerConfig(
            instances=self.gpu_budget // per_engine if self.gpu_budget else engines,
            slo=SLO(self.ttft_slo_s, self.itl_slo_s),
            interval_s=self.interval_s,
            cooldown_s=self.cooldown_s,
            hysteresis=self.hysteresis,
            batch_limit=decode.max_num_seqs,
            token_budget=prefill.max_num_batched_tokens,
        )
        return PlannerSetup(config, PerformanceModel.load(Path(self.model)))


@dataclass(frozen=True, slots=True)
class SplitChange:
    decision: Decision
    applied: tuple[int, int] | None  # the pool sizes after the change; None: it failed
    seconds: float


class PlanningLoop:
    def __init__(
        self,
        planner: ClosedLoopPlanner,
        split: Callable[[], tuple[int, int]],
        resize: Callable[[ScalingDecision], Awaitable[ScalingOutcome]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._planner = planner
        self._split = split
        self._resize = resize
        self._clock = clock
        self._finished: list[FinishedRequest] = []
        self._arrivals = 0
        # The planner's clock starts at 0 here; routers stamp arrivals on the wall clock.
        self._epoch = clock()
        self._start = 0.0
        self.decisions: deque[Decision] = deque(maxlen=100)
        self.changes: list[SplitChange] = []
        self.log_lines: list[str] = []  # every decision and change, for `pdserve serve` to print

    def add(self, report: RouterReport) -> None:
        self._finished.extend(dataclasses.replace(r, arrival_s=r.arrival_s - self._epoch) for r in report.finished)
        self._arrivals += report.arrivals

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.step()
            except Exception:  # one bad interval must not end the loop
                log.exception("planner interval failed")

    async def step(self) -> Decision:
        """Observe the interval that just ended, decide, and apply a change."""
        end = self._clock() - self._epoch
        prefill, decode = self._split()
        observation = IntervalObservation(self._start, end, prefill, decode, tuple(self._finished), self._arrivals)
        self._finished, self._arrivals, self._start = [], 0, end
        # The search simulates every candidate split (CPU-bound): off the loop that answers routers.
        decision = await asyncio.to_thread(self._planner.step, observation)
        self.decisions.append(decision)
        self.log_lines.append(decision.log_line())
        _export(decision)
        if decision.changed:
            target = decision.recommended
            started = time.monotonic()
            try:
                scaling = ScalingDecision(target.prefill, target.decode, f"planner: {decision.reason}")
                applied: tuple[int, int] | None = (await self._resize(scaling)).after
            except Exception:
                log.exception("planner could not change the split to %s", target.label)
                applied = None
            seconds = time.monotonic() - started
            self.changes.append(SplitChange(decision, applied, seconds))
            CHANGE_SECONDS.observe(seconds)
            outcome = f"took {seconds:.1f} s" if applied is not None else f"failed after {seconds:.1f} s"
            self.log_lines.append(f"planner split change {decision.current.label} -> {target.label} {outcome}")
            log.info(self.log_lines[-1])
            if applied is not None:
                SPLIT.labels("prefill", "running").set(applied[0])
                SPLIT.labels("decode", "running").set(applied[1])
        return decision


def _export(decision: Decision) -> None:
    DECISIONS.labels(decision.action).inc()
    for which, split in (("running", decision.current), ("recommended", decision.recommended)):
        SPLIT.labels("prefill", which).set(split.prefill)
        SPLIT.labels("decode", which).set(split.decode)
    for which, goodput in (
        ("running", decision.current_goodput_rps),
        ("recommended", decision.recommended_goodput_rps),
    ):
        if goodput is not None:
            GOODPUT.labels(which).set(goodput)
    for gauge, observed, predicted in (
        (TTFT_P90, decision.observed_ttft_p90_s, decision.predicted_ttft_p90_s),
        (ITL_P90, decision.observed_itl_p90_s, decision.predicted_itl_p90_s),
    ):
        for source, value in (("observed", observed), ("predicted", predicted)):
            if value is not None:
                gauge.labels(source).set(value)
    FORECAST.set(decision.forecast_rate_rps)
    CORRECTION.labels("prefill").set(decision.corrections.prefill)
    CORRECTION.labels("decode").set(decision.corrections.decode)
