"""What the closed-loop planner sees of the live workload: one interval's finished requests as
the router measured them, their summary, and the forecast of the next interval.

The forecaster is deliberately simple:
- rate: an exponentially weighted mean of the intervals' arrival rates. A 60 s window at
  5 req/s counts 300 +- 17 arrivals (Poisson), so one interval alone is 6% noise; the mean
  (weight 0.5 by default) halves its variance and still covers 75% of a step in two intervals.
- length mix: the latest window's (prompt, output) pairs as they came, no older ones. A mix
  shift is a step (another application's traffic arrives), not a drift, and the decision has
  to see it within an interval; noise in the mix is left to the planner (hysteresis, and a
  gain that must persist into a second window unless the running split is falling short)
  rather than smoothed here, which would add lag to every shift. A window with too few
  requests keeps the previous mix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from messages.timings import FinishedRequest, LatencySummary
from planner.simulator import Workload


@dataclass(frozen=True, slots=True)
class IntervalObservation:
    """One planner interval [start_s, end_s): the requests that finished in it and the split
    that served them. `arrivals` is the router's count of requests that arrived in it,
    finished or not (under overload fewer finish than arrive); None: the finished count."""

    start_s: float
    end_s: float
    prefill: int  # instances serving the interval; 0 = colocated
    decode: int
    requests: tuple[FinishedRequest, ...]
    arrivals: int | None = None

    def __post_init__(self) -> None:
        if self.end_s <= self.start_s:
            raise ValueError(f"an interval must end after it starts: {self.start_s} .. {self.end_s}")
        if self.prefill < 0 or self.decode < 1:
            raise ValueError(
                f"the split serving an interval needs prefill >= 0, decode >= 1: {self.prefill}P:{self.decode}D"
            )
        if self.arrivals is not None and self.arrivals < 0:
            raise ValueError("arrivals counts requests: it cannot be negative")


@dataclass(frozen=True, slots=True, eq=False)
class WindowSummary:
    """One observation reduced to what the planner uses. Per-request arrays are sorted by
    arrival, so they replay directly as the simulator's workload (`simulator.simulate_at`)."""

    start_s: float
    end_s: float
    arrivals: int  # requests that arrived in the window, finished or not
    arrival_rate_rps: float
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray  # of each prompt, served from a prefix cache
    ttft_s: LatencySummary
    itl_s: LatencySummary

    @property
    def requests(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def summarize(observation: IntervalObservation) -> WindowSummary:
    requests = sorted(observation.requests, key=lambda r: r.arrival_s)
    duration = observation.end_s - observation.start_s
    arrivals = len(requests) if observation.arrivals is None else observation.arrivals
    return WindowSummary(
        start_s=observation.start_s,
        end_s=observation.end_s,
        arrivals=arrivals,
        arrival_rate_rps=arrivals / duration,
        arrival_s=np.array([r.arrival_s for r in requests], dtype=float),
        prompt_tokens=np.array([r.prompt_tokens for r in requests], dtype=np.int64),
        output_tokens=np.array([r.output_tokens for r in requests], dtype=np.int64),
        cached_tokens=np.array([r.cached_tokens for r in requests], dtype=np.int64),
        ttft_s=LatencySummary.of([r.ttft_s for r in requests]),
        itl_s=LatencySummary.of([r.itl_s for r in requests]),
    )


@dataclass(frozen=True, slots=True, eq=False)
class Forecast:
    """The next interval: an arrival rate and a length mix ((prompt, output, cached) triples:
    the prefix-cache hits the window saw come with their requests; empty until some window
    had enough requests)."""

    rate_rps: float
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray

    @property
    def has_mix(self) -> bool:
        return bool(len(self.prompt_tokens))

    def workload(self, count: int, seed: int) -> Workload:
        """Poisson arrivals carrying the mix: the search's workload (it rescales the rate)."""
        if not self.has_mix:
            raise ValueError("no length mix yet: observe a window with enough finished requests first")
        return Workload.resample(self.prompt_tokens, self.output_tokens, count, seed, self.cached_tokens)


def forecast(previous: Forecast | None, window: WindowSummary, rate_weight: float, min_requests: int) -> Forecast:
    """The next interval from the last forecast and the window just observed (see the module
    docstring for why): rate = rate_weight x observed + (1 - rate_weight) x previous."""
    if not 0 < rate_weight <= 1:
        raise ValueError(f"rate_weight must be in (0, 1], got {rate_weight}")
    if previous is None:
        rate = window.arrival_rate_rps
    else:
        rate = rate_weight * window.arrival_rate_rps + (1 - rate_weight) * previous.rate_rps
    if window.requests >= min_requests or previous is None:
        return Forecast(rate, window.prompt_tokens, window.output_tokens, window.cached_tokens)
    return Forecast(rate, previous.prompt_tokens, previous.output_tokens, previous.cached_tokens)
