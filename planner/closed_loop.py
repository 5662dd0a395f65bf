"""The closed-loop planner: every interval, observe the live workload, correct the model,
forecast the next interval, search the splits of the instance budget, and change the split
only when it pays.

One interval (`ClosedLoopPlanner.step`, on the observation of the interval just ended):
1. summarise the window (`planner.observe`): arrival rate, length mix, TTFT / ITL percentiles;
2. predict the window: replay its requests, at their own arrival times, on the running split
   with the corrected model; observed / predicted medians of TTFT and ITL move the prefill
   and decode correction factors (`Corrections.updated`);
3. forecast the next interval (`planner.observe.forecast`);
4. search (`planner.search`) every disaggregated split of the budget under the forecast mix
   with the corrected model: each split's goodput, the highest sustainable rate at which the
   SLO's attainment target is met;
5. change to the best split only when its goodput beats the running split's by the
   hysteresis (relative), the cool-down since the last change has passed, and the change is
   needed now (the running split falls short of the forecast rate by more than the
   hysteresis) or the gain persists (it clears the hysteresis on the previous window's mix
   too): a real shift passes at once or within an interval, noise in the mix does not.

Every step returns a `Decision` and logs it as one line. Nothing here touches a cluster: the
controller feeds `IntervalObservation`s and applies "change" decisions; `planner.replay`
does both on a simulated clock for the tests and bench/planner_shift.py.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Literal

from messages.timings import SLO, LatencySummary
from planner.model import PerformanceModel
from planner.observe import Forecast, IntervalObservation, WindowSummary, forecast, summarize
from planner.search import Candidate, best_of, max_goodput
from planner.simulator import DEFAULT_BATCH_LIMIT, DEFAULT_TOKEN_BUDGET, Split, simulate_at

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    instances: int  # the budget: prefill + decode engines, every split uses all of them
    slo: SLO
    interval_s: float = 60.0  # how often the controller observes and calls `step` (its clock, not ours)
    cooldown_s: float = (
        180.0  # least time between two changes (one restarts engines, or drains one under --switch-roles)
    )
    hysteresis: float = 0.10  # least relative goodput gain worth a change
    rate_weight: float = 0.5  # the newest interval's weight in the forecast rate
    correction_weight: float = 0.5  # how far one interval moves a correction toward its target
    correction_bounds: tuple[float, float] = (0.5, 2.0)  # a factor outside is a broken model, not drift
    min_requests: int = 20  # finished (or, once the mix is known, arrived) requests an interval needs
    batch_limit: int = DEFAULT_BATCH_LIMIT  # the decode engines' max_num_seqs
    token_budget: int = DEFAULT_TOKEN_BUDGET  # the prefill engines' max_num_batched_tokens
    search_requests: int = 200  # requests per simulation of the search
    seed: int = 0  # of the search workload: the same mix gives the same answer

    def __post_init__(self) -> None:
        problems = []
        if self.instances < 2:
            problems.append(f"instances {self.instances}: a disaggregated split needs at least 2")
        if self.interval_s <= 0:
            problems.append(f"interval_s {self.interval_s}: must be positive")
        if self.cooldown_s < 0:
            problems.append(f"cooldown_s {self.cooldown_s}: must be >= 0 (0: change at any interval)")
        if self.hysteresis < 0:
            problems.append(f"hysteresis {self.hysteresis}: must be >= 0 (a relative gain, 0.1 = 10%)")
        for name in ("rate_weight", "correction_weight"):
            if not 0 < getattr(self, name) <= 1:
                problems.append(f"{name} {getattr(self, name)}: must be in (0, 1]")
        low, high = self.correction_bounds
        if not 0 < low <= 1 <= high:
            problems.append(f"correction_bounds {self.correction_bounds}: need 0 < low <= 1 <= high")
        if self.min_requests < 2:
            problems.append(f"min_requests {self.min_requests}: percentiles need at least 2")
        if self.batch_limit < 1 or self.token_budget < 1 or self.search_requests < 10:
            problems.append("batch_limit and token_budget must be >= 1, search_requests >= 10")
        if problems:
            raise ValueError("invalid planner config: " + "; ".join(problems))

    def split(self, prefill: int, decode: int) -> Split:
        return Split(prefill, decode, self.batch_limit, self.token_budget)


@dataclass(frozen=True, slots=True)
class Corrections:
    """Factors on the model's prefill and decode times that make it predict what was observed.

    Updated multiplicatively from observed / predicted ratios of the prediction made with the
    current factors, a damped fixed-point iteration (log f += weight x log ratio): it settles
    where prediction meets observation even though TTFT is not proportional to prefill time
    (queueing). Medians, not p90s: the tail moves far more than the cost terms near
    saturation, and a few stragglers should not rescale the model. TTFT moves the prefill
    factor, mean ITL the decode factor; the serving path and transfer are not scaled, so a
    TTFT error from them lands on prefill, bounded by the clamp."""

    prefill: float = 1.0
    decode: float = 1.0

    def apply(self, model: PerformanceModel) -> PerformanceModel:
        return model.scaled(prefill=self.prefill, decode=self.decode)

    def updated(self, ttft_ratio: float, itl_ratio: float, weight: float, bounds: tuple[float, float]) -> Corrections:
        low, high = bounds

        def move(factor: float, ratio: float) -> float:
            return min(high, max(low, factor * ratio**weight))

        return Corrections(move(self.prefill, ttft_ratio), move(self.decode, itl_ratio))


Action = Literal["change", "hold"]


@dataclass(frozen=True, slots=True)
class Decision:
    time_s: float  # the end of the interval it was made on
    action: Action
    reason: str
    current: Split
    recommended: Split  # the best split for the forecast (the current one when nothing beats it)
    current_goodput_rps: float | None  # predicted for the forecast mix; None when not searched
    recommended_goodput_rps: float | None
    forecast_rate_rps: float
    forecast_prompt_tokens: float  # means of the forecast mix (0 before any)
    forecast_output_tokens: float
    # The window just observed on the running split, and the model's prediction of it.
    observed_ttft_p90_s: float | None
    predicted_ttft_p90_s: float | None
    observed_itl_p90_s: float | None
    predicted_itl_p90_s: float | None
    corrections: Corrections  # after this interval's update: the ones the search used
    search_s: float  # wall time of the search and its confirmation

    @property
    def changed(self) -> bool:
        return self.action == "change"

    def log_line(self) -> str:
        goodput = (
            f"goodput {self.current_goodput_rps:.2f} -> {self.recommended_goodput_rps:.2f} req/s"
            if self.current_goodput_rps is not None and self.recommended_goodput_rps is not None
            else "goodput not searched"
        )
        return (
            f"planner t={self.time_s:.0f}s {self.action} {self.current.label} -> {self.recommended.label}: "
            f"{self.reason}; {goodput}; forecast {self.forecast_rate_rps:.2f} req/s, prompt "
            f"{self.forecast_prompt_tokens:.0f} / output {self.forecast_output_tokens:.0f} tokens; "
            f"TTFT p90 observed {_ms(self.observed_ttft_p90_s)} predicted {_ms(self.predicted_ttft_p90_s)}; "
            f"ITL p90 observed {_ms(self.observed_itl_p90_s)} predicted {_ms(self.predicted_itl_p90_s)}; "
            f"corrections prefill x{self.corrections.prefill:.2f} decode x{self.corrections.decode:.2f}; "
            f"search {self.search_s:.2f} s"
        )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _ratio(observed: float | None, predicted: float | None) -> float:
    """observed / predicted, 1 (no evidence) when either is missing or 0."""
    if not observed or not predicted:
        return 1.0
    return observed / predicted


class ClosedLoopPlanner:
    """Call `step` once per interval with what the router observed; apply a "change"
    decision's `recommended` split (the planner reads the running split back from the next
    observation, so a change the controller could not make is simply seen as not made)."""

    def __init__(self, config: PlannerConfig, model: PerformanceModel) -> None:
        self.config = config
        self.model = model
        self.corrections = Corrections()
        self.forecast: Forecast | None = None
        self.last_change_s: float | None = None
        self._changed_last_step = False

    def step(self, observation: IntervalObservation) -> Decision:
        config = self.config
        window = summarize(observation)
        current = config.split(observation.prefill, observation.decode)
        predicted_ttft, predicted_itl = self._predict(window, current)
        previous = self.forecast
        expected = self.forecast = forecast(previous, window, config.rate_weight, config.min_requests)
        recommended, goodputs, search_s = current, (None, None), 0.0
        # An overloaded split finishes fewer requests than arrive: counting finished ones
        # alone would hold it exactly when it falls behind. Arrivals are evidence enough
        # once some window has given the length mix.
        overloaded = window.arrivals >= config.min_requests and expected.has_mix
        if window.requests < config.min_requests and not overloaded:
            action: Action = "hold"
            reason = (
                f"{window.requests} requests finished and {window.arrivals} arrived in the interval, "
                f"fewer than {config.min_requests}"
            )
        else:
            started = time.perf_counter()
            model = self.corrections.apply(self.model)
            mine, best = self._search(model, expected, current)
            action, reason = self._verdict(observation.end_s, model, expected.rate_rps, mine, best, previous)
            search_s = time.perf_counter() - started
            if best.goodput_rps > mine.goodput_rps:
                recommended = best.split
            goodputs = (mine.goodput_rps, max(mine.goodput_rps, best.goodput_rps))
        decision = Decision(
            time_s=observation.end_s,
            action=action,
            reason=reason,
            current=current,
            recommended=recommended,
            current_goodput_rps=goodputs[0],
            recommended_goodput_rps=goodputs[1],
            forecast_rate_rps=expected.rate_rps,
            forecast_prompt_tokens=float(expected.prompt_tokens.mean()) if expected.has_mix else 0.0,
            forecast_output_tokens=float(expected.output_tokens.mean()) if expected.has_mix else 0.0,
            observed_ttft_p90_s=window.ttft_s.p90,
            predicted_ttft_p90_s=predicted_ttft,
            observed_itl_p90_s=window.itl_s.p90,
            predicted_itl_p90_s=predicted_itl,
            corrections=self.corrections,
            search_s=search_s,
        )
        if decision.changed:
            self.last_change_s = decision.time_s
        self._changed_last_step = decision.changed
        log.info(decision.log_line())
        return decision

    def _predict(self, window: WindowSummary, current: Split) -> tuple[float | None, float | None]:
        """The window replayed on the running split with the current model: its TTFT and ITL
        p90, and (unless a change was just made) the corrections moved by the medians."""
        if window.requests < self.config.min_requests:
            return None, None
        model = self.corrections.apply(self.model)
        timeline = simulate_at(
            model, current, window.arrival_s, window.prompt_tokens, window.output_tokens, window.cached_tokens
        )
        ttft, itl = LatencySummary.of(timeline.ttft), LatencySummary.of(timeline.tpot)
        # The interval after a change holds the changeover (engines restarting, queues moving):
        # its latencies say nothing about the model.
        if not self._changed_last_step:
            self.corrections = self.corrections.updated(
                _ratio(window.ttft_s.p50, ttft.p50),
                _ratio(window.itl_s.p50, itl.p50),
                self.config.correction_weight,
                self.config.correction_bounds,
            )
        return ttft.p90, itl.p90

    def _search(self, model: PerformanceModel, expected: Forecast, current: Split) -> tuple[Candidate, Candidate]:
        """The running split and the best split for the forecast mix, the same simulated
        requests for every split. Every disaggregated split of the budget competes (the live
        controller resizes two pools; it does not colocate); `best_of` skips those whose
        capacity cannot beat the best so far."""
        config = self.config
        splits = [config.split(prefill, config.instances - prefill) for prefill in range(1, config.instances)]
        return best_of(model, expected.workload(config.search_requests, config.seed), config.slo, splits, current)

    def _verdict(
        self,
        now: float,
        model: PerformanceModel,
        rate: float,
        mine: Candidate,
        best: Candidate,
        previous: Forecast | None,
    ) -> tuple[Action, str]:
        """Change when the gain clears the hysteresis, the cool-down has passed, and either the
        running split falls short of the forecast rate by more than the hysteresis (requests
        are missing the SLO: act now) or the gain clears the hysteresis on the window before's
        mix too (a shift persists; noise in the mix does not)."""
        config = self.config
        if best.goodput_rps <= mine.goodput_rps:
            return (
                "hold",
                "no split meets the SLO for the forecast" if best.goodput_rps == 0 else "the running split is the best",
            )
        gain = _gain(mine.goodput_rps, best.goodput_rps)
        if gain < config.hysteresis:
            return "hold", f"gain {gain:+.0%} is under the hysteresis {config.hysteresis:.0%}"
        since = math.inf if self.last_change_s is None else now - self.last_change_s
        if since < config.cooldown_s:
            return (
                "hold",
                f"gain {gain:+.0%}, but {since:.0f} s since the last change: cool-down {config.cooldown_s:.0f} s",
            )
        clears = f"gain {gain:+.0%} clears the hysteresis {config.hysteresis:.0%}"
        if rate > (1 + config.hysteresis) * mine.goodput_rps:  # short by more than noise: act now
            return "change", f"{clears}; the running split falls short of the forecast rate"
        if previous is None or not previous.has_mix:
            return "hold", f"gain {gain:+.0%} with room for the forecast rate: waiting for a second window"
        workload = previous.workload(config.search_requests, config.seed)
        before = _gain(
            *(max_goodput(model, c.split, workload, config.slo, c.split.instances).goodput_rps for c in (mine, best))
        )
        if before < config.hysteresis:
            return "hold", f"gain {gain:+.0%}, but {before:+.0%} on the window before: not persistent yet"
        return "change", f"{clears}, {before:+.0%} on the window before"


def _gain(mine: float, best: float) -> float:
    """Relative goodput gain of `best` over `mine`; infinite from nothing."""
    if mine > 0:
        return best / mine - 1
    return math.inf if best > 0 else 0.0
