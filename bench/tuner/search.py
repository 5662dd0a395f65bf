"""Placement search: the prefill:decode split and decode batch limit with the most goodput.

Goodput, as DistServe defines it: the highest arrival rate at which at least the SLO's
attainment target (p90: 90%) of requests meet both the TTFT and the ITL (TPOT) SLO. For each
candidate placement it is found by bisection on the rate, every probe a full simulation of
the same workload rescaled to that rate. All candidates use the same number of instances,
so the best goodput is also the best goodput per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from bench.tuner.model import PerformanceModel
from bench.tuner.simulator import (
    DEFAULT_TOKEN_BUDGET,
    SLO,
    Placement,
    Summary,
    Workload,
    simulate,
)

DEFAULT_BATCH_LIMITS = (16, 32, 64, 128, 256)
BISECTIONS = 8  # rate resolution: 1/256 of the first bracket
MAX_DOUBLINGS = 12


@dataclass(frozen=True, slots=True)
class SearchSpace:
    instances: int
    gpus_per_instance: int = 1
    batch_limits: tuple[int, ...] = DEFAULT_BATCH_LIMITS
    token_budget: int = DEFAULT_TOKEN_BUDGET
    include_colocated: bool = True  # the baseline: every instance does both phases

    def __post_init__(self) -> None:
        if self.instances < 2 and not self.include_colocated:
            raise ValueError("a disaggregated split needs at least two instances")

    @property
    def gpus(self) -> int:
        return self.instances * self.gpus_per_instance

    def splits(self) -> range:
        """Prefill instance counts; 0 is colocated."""
        return range(0 if self.include_colocated else 1, self.instances)


@dataclass(frozen=True, slots=True)
class Candidate:
    placement: Placement
    goodput_rps: float  # 0 when even a trickle misses the SLO
    goodput_per_gpu: float
    summary: Summary | None  # simulated at goodput_rps; None when it is 0
    limit_reached: bool  # some simulation of the bisection filled a decode batch to the limit


@dataclass(frozen=True, slots=True)
class SearchResult:
    slo: SLO
    space: SearchSpace
    candidates: tuple[Candidate, ...]  # by split, then batch limit, both increasing

    @property
    def best(self) -> Candidate:
        # max keeps the first of equals: colocated before disaggregated, small limits first.
        return max(self.candidates, key=lambda c: c.goodput_rps)

    def best_per_split(self) -> list[Candidate]:
        """The best batch limit for each prefill instance count, in increasing count."""
        splits: dict[int, Candidate] = {}
        for candidate in self.candidates:
            current = splits.get(candidate.placement.prefill)
            if current is None or candidate.goodput_rps > current.goodput_rps:
                splits[candidate.placement.prefill] = candidate
        return [splits[prefill] for prefill in sorted(splits)]


def capacity_estimate(model: PerformanceModel, placement: Placement, workload: Workload) -> float:
    """Requests/s the pools could sustain busy all the time at their best batching: the
    bisection's first bracket (a guess; the bisection widens it when low). It ignores the
    batch limit, so every limit of a split starts from the same bracket (see
    `_split_candidates`)."""
    prompt = workload.prompt_tokens.astype(float)
    cost = model.prefill
    # A full token budget of prompts shares the fixed per-batch cost.
    prompts_per_batch = max(1.0, placement.token_budget / prompt.mean())
    prefill_s = cost.fixed_s / prompts_per_batch + float(
        np.mean(cost.per_token_s * prompt + cost.per_token_pair_s * prompt**2)
    )
    # Time per token falls with the batch up to the knee, then tends to the compute cost.
    decode = model.decode
    context = prompt.mean()
    knee = max(1.0, decode.knee)
    per_token_s = min(
        decode.seconds(knee, knee * context) / knee,
        decode.per_sequence_s + decode.per_context_token_s * context + decode.compute_per_sequence_s,
    )
    decode_s = float(workload.output_tokens.mean()) * per_token_s
    if placement.colocated:
        return placement.decode / (prefill_s + decode_s)
    return min(placement.prefill / prefill_s, placement.decode / decode_s)


def max_goodput(model: PerformanceModel, placement: Placement, workload: Workload, slo: SLO, gpus: int) -> Candidate:
    """Bisection on the arrival rate for the highest rate that still meets the SLO."""
    passing: Summary | None = None
    peak_batch = 0

    def attains(rate: float) -> bool:
        nonlocal passing, peak_batch
        timeline = simulate(model, placement, workload, rate)
        peak_batch = max(peak_batch, timeline.peak_batch)
        if timeline.meets(slo).mean() < slo.attainment_target:
            return False
        passing = timeline.summary(rate, slo)
        return True

    low, high = 0.0, float(capacity_estimate(model, placement, workload))
    for _ in range(MAX_DOUBLINGS):
        if not attains(high):
            break
        low, high = high, 2 * high
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if attains(middle) else (low, middle)
    # The last pass was at `low`.
    return Candidate(placement, low, low / gpus, passing, peak_batch >= placement.batch_limit)


def _split_candidates(
    model: PerformanceModel, workload: Workload, slo: SLO, space: SearchSpace, prefill: int
) -> list[Candidate]:
    candidates: list[Candidate] = []
    for limit in sorted(space.batch_limits):
        placement = Placement(prefill, space.instances - prefill, limit, space.token_budget)
        if candidates and not candidates[-1].limit_reached:
            # No simulation filled the smaller limit: from the same bracket a larger one
            # replays the same simulations, so the same bisection.
            candidates.append(replace(candidates[-1], placement=placement))
        else:
            candidates.append(max_goodput(model, placement, workload, slo, space.gpus))
    return candidates


def search(model: PerformanceModel, workload: Workload, slo: SLO, space: SearchSpace) -> SearchResult:
    candidates = [c for prefill in space.splits() for c in _split_candidates(model, workload, slo, space, prefill)]
    return SearchResult(slo, space, tuple(candidates))
