"""A simulated cluster on a simulated clock, to drive the closed-loop planner without one.

A trace (arrival times and lengths) is served interval by interval by a "true" performance
model, which may differ from the planner's on purpose; each interval becomes the
`IntervalObservation` the router would report, the planner decides, and its change applies
from the next interval on, after a changeover.

Simplifications, stated:
- each interval is simulated on an empty cluster: requests in flight at a boundary are not
  carried over. An overloaded interval's backlog therefore vanishes at its end, which
  flatters a split that cannot keep up (the static baseline, in a shift);
- the observation holds every request that arrived in the interval, with its latencies
  (the live router reports those that finished in it);
- a change takes `changeover_s`: the instances changing role serve nothing for that long
  (drain, engine restart), so requests arriving meanwhile are served by the instances both
  splits share, then the rest by the new split (two empty-cluster simulations).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from messages.timings import SLO, FinishedRequest
from planner.closed_loop import ClosedLoopPlanner, Decision
from planner.model import PerformanceModel
from planner.observe import IntervalObservation
from planner.simulator import Lengths, Split, Workload, simulate_at


@dataclass(frozen=True, slots=True)
class Phase:
    """A stretch of traffic with one mix: Poisson arrivals at `rate_rps` for `duration_s`."""

    duration_s: float
    rate_rps: float
    prompt: Lengths
    output: Lengths


@dataclass(frozen=True, slots=True, eq=False)
class Trace:
    arrival_s: np.ndarray  # sorted
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    duration_s: float

    @classmethod
    def of(cls, phases: Sequence[Phase], seed: int = 0) -> Trace:
        parts, start = [], 0.0
        seeds = np.random.default_rng(seed).integers(0, 2**31, len(phases))
        for phase, phase_seed in zip(phases, seeds):
            count = max(1, round(phase.rate_rps * phase.duration_s))
            workload = Workload.poisson(count, phase.prompt, phase.output, seed=int(phase_seed))
            parts.append((start + workload.arrivals(count / phase.duration_s), workload))
            start += phase.duration_s
        return cls(
            np.concatenate([arrivals for arrivals, _ in parts]),
            np.concatenate([w.prompt_tokens for _, w in parts]),
            np.concatenate([w.output_tokens for _, w in parts]),
            start,
        )

    def between(self, start_s: float, end_s: float) -> slice:
        low, high = np.searchsorted(self.arrival_s, [start_s, end_s])
        return slice(int(low), int(high))


@dataclass(frozen=True, slots=True)
class IntervalResult:
    split: Split  # the split serving the interval once any changeover is done
    observation: IntervalObservation
    good: int  # requests that arrived in the interval and met the SLO
    decision: Decision | None  # the planner's, at the interval's end; None for a static split

    @property
    def goodput_rps(self) -> float:
        return self.good / (self.observation.end_s - self.observation.start_s)


def serve(
    truth: PerformanceModel,
    trace: Trace,
    start_s: float,
    end_s: float,
    before: Split,
    after: Split,
    changeover_s: float,
) -> IntervalObservation:
    """Requests arriving in [start_s, end_s) served by `truth`; `after` is the split from
    `start_s` on, reached from `before` through a changeover when they differ."""
    stages = [(start_s, end_s, after)]
    if before != after and changeover_s > 0:
        shared = Split(
            min(before.prefill, after.prefill), min(before.decode, after.decode), after.batch_limit, after.token_budget
        )
        handover = min(end_s, start_s + changeover_s)
        stages = [(start_s, handover, shared), (handover, end_s, after)]
    requests: list[FinishedRequest] = []
    for low, high, split in stages:
        picked = trace.between(low, high)
        arrivals = trace.arrival_s[picked]
        if not len(arrivals):
            continue
        timeline = simulate_at(truth, split, arrivals, trace.prompt_tokens[picked], trace.output_tokens[picked])
        requests += [
            FinishedRequest(float(a), int(p), int(o), float(ttft), float(itl))
            for a, p, o, ttft, itl in zip(
                arrivals, trace.prompt_tokens[picked], trace.output_tokens[picked], timeline.ttft, timeline.tpot
            )
        ]
    return IntervalObservation(start_s, end_s, after.prefill, after.decode, tuple(requests), arrivals=len(requests))


def _meets(request: FinishedRequest, slo: SLO) -> bool:
    return request.ttft_s <= slo.ttft_s and request.itl_s <= slo.itl_s


def replay(
    truth: PerformanceModel,
    trace: Trace,
    start: Split,
    interval_s: float,
    slo: SLO,
    planner: ClosedLoopPlanner | None = None,
    changeover_s: float = 0.0,
) -> list[IntervalResult]:
    """Serve the trace interval by interval; with a planner, apply each "change" decision
    from the next interval on. Without one, `start` serves the whole trace (a static split)."""
    results: list[IntervalResult] = []
    before = running = start
    for index in range(int(np.ceil(trace.duration_s / interval_s - 1e-9))):
        low, high = index * interval_s, min(trace.duration_s, (index + 1) * interval_s)
        observation = serve(truth, trace, low, high, before, running, changeover_s)
        decision = planner.step(observation) if planner else None
        good = sum(_meets(request, slo) for request in observation.requests)
        results.append(IntervalResult(running, observation, good, decision))
        before = running
        if decision is not None and decision.changed:
            running = decision.recommended
    return results


def goodput(results: Sequence[IntervalResult]) -> float:
    """Requests meeting the SLO per second over the whole replay."""
    duration = results[-1].observation.end_s - results[0].observation.start_s
    return sum(result.good for result in results) / duration
