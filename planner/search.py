"""Split search: the prefill:decode split and decode batch limit with the most goodput.

Goodput, as DistServe defines it: the highest arrival rate at which at least the SLO's
attainment target (p90: 90%) of requests meet both the TTFT and the ITL (TPOT) SLO. For each
candidate split it is found by bisection on the rate, every probe a full simulation of
the same workload rescaled to that rate. All candidates use the same number of instances,
so the best goodput is also the best goodput per GPU.

Only sustainable rates count: a finite simulation of an overloaded queue can end before its
waiting time crosses a loose SLO, so a rate above the split's service capacity (the
busier pool's bound, `capacity_bound`) is never reported, whatever the finite run says.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from configuration.fields import knob
from planner.model import PerformanceModel
from planner.simulator import (
    DEFAULT_TOKEN_BUDGET,
    SLO,
    Split,
    Summary,
    Workload,
    simulate,
)

DEFAULT_BATCH_LIMITS = (16, 32, 64, 128, 256)
BISECTIONS = 8  # rate resolution: 1/256 of the first bracket
MAX_DOUBLINGS = 12


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Every split of a GPU budget into engine instances of one size, at each decode batch limit."""

    gpus: int = knob(help="GPUs to place")
    # A model's figures are for engines of one TP size: the search counts in those (`sized_for`).
    gpus_per_instance: int | None = knob(
        None, help="GPUs per engine instance, its TP size (unset: the size the figures were measured at)"
    )
    batch_limits: tuple[int, ...] = knob(DEFAULT_BATCH_LIMITS, help="decode batch limits to try")
    token_budget: int = knob(DEFAULT_TOKEN_BUDGET, help="prompt tokens per prefill batch")
    # The baseline: every instance does both phases.
    include_colocated: bool = knob(True, flag="colocated", help="try the colocated baseline too")

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {self.gpus}")
        if not self.batch_limits or min(self.batch_limits) < 1:
            raise ValueError(f"batch_limits must be one or more limits >= 1, got {self.batch_limits}")
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be >= 1, got {self.token_budget}")
        if self.gpus_per_instance is None:
            return
        if self.gpus_per_instance < 1 or self.gpus % self.gpus_per_instance:
            raise ValueError(
                f"gpus {self.gpus} is not a positive multiple of gpus_per_instance {self.gpus_per_instance}"
            )
        if self.instances < 2 and not self.include_colocated:
            raise ValueError(f"gpus {self.gpus}: a disaggregated split needs at least two instances")

    def sized_for(self, model: PerformanceModel) -> SearchSpace:
        """This space in instances of the TP size `model`'s figures were measured at."""
        prefill_tp, decode_tp = model.tensor_parallel
        if prefill_tp != decode_tp:
            raise ValueError(
                f"the probe measured TP {prefill_tp} prefill and TP {decode_tp} decode engines; the tuner sizes both "
                "pools in instances of one size: probe with equal --prefill-tp and --decode-tp"
            )
        if self.gpus_per_instance not in (None, prefill_tp):
            raise ValueError(
                f"gpus_per_instance {self.gpus_per_instance}, but the figures are for TP {prefill_tp} engines: "
                f"probe engines of TP {self.gpus_per_instance} first, or leave --gpus-per-instance out"
            )
        return replace(self, gpus_per_instance=prefill_tp)

    @property
    def instances(self) -> int:
        if self.gpus_per_instance is None:
            raise ValueError("gpus_per_instance is unset: size the space for a model first (sized_for)")
        return self.gpus // self.gpus_per_instance

    def splits(self) -> range:
        """Prefill instance counts; 0 is colocated."""
        return range(0 if self.include_colocated else 1, self.instances)


@dataclass(frozen=True, slots=True)
class CapacityBound:
    """The most requests/s a split can serve in steady state, and which pool sets it."""

    rate_rps: float
    bound: str  # "prefill", "decode" (disaggregated) or "colocated"


@dataclass(frozen=True, slots=True)
class Candidate:
    split: Split
    goodput_rps: float  # 0 when even a trickle misses the SLO; never above capacity
    goodput_per_gpu: float
    summary: Summary | None  # simulated at goodput_rps; None when it is 0
    limit_reached: bool  # some simulation of the bisection filled a decode batch to the limit
    capacity: CapacityBound | None = None


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
            current = splits.get(candidate.split.prefill)
            if current is None or candidate.goodput_rps > current.goodput_rps:
                splits[candidate.split.prefill] = candidate
        return [splits[prefill] for prefill in sorted(splits)]


def capacity_estimate(model: PerformanceModel, split: Split, workload: Workload) -> float:
    """Requests/s the pools could sustain busy all the time at their best batching: the
    bisection's first bracket (a guess; the bisection widens it when low). It ignores the
    batch limit, so every limit of a split starts from the same bracket (see
    `_split_candidates`)."""
    prompt = workload.prompt_tokens.astype(float)
    computed = workload.uncached_tokens.astype(float)  # a prefix cache serves the rest
    cost = model.prefill
    # A full token budget of prompts shares the fixed per-batch cost.
    prompts_per_batch = max(1.0, split.token_budget / computed.mean())
    prefill_s = cost.fixed_s / prompts_per_batch + float(
        np.mean(cost.per_token_s * computed + cost.per_token_pair_s * computed * prompt)
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
    if split.colocated:
        return split.decode / (prefill_s + decode_s)
    return min(split.prefill / prefill_s, split.decode / decode_s)


def capacity_bound(model: PerformanceModel, split: Split, workload: Workload) -> CapacityBound:
    """Requests/s each pool serves when it never idles, from the model's per-token costs
    exactly as the simulator charges them: prefill in full token budgets of mean-length
    prompts; decode with every batch at its limit, a sequence holding a slot for its output
    tokens but the first (prefill samples that) at the mean context (prompt plus half the
    output). The host slowdown (CPU engines) depends on the rate itself: a fixed point.
    Transfers are latency only in the simulator (no shared link), so they bound nothing here."""
    prompt = float(workload.prompt_tokens.mean())
    computed = float(workload.uncached_tokens.mean())  # a prefix cache serves the rest
    output = float(workload.output_tokens.mean())
    per_batch = max(1.0, split.token_budget // computed)
    prefill_s = model.prefill.seconds(per_batch * computed, per_batch * computed * prompt) / per_batch
    limit = split.batch_limit
    step_s = model.decode.seconds(limit, limit * (prompt + output / 2))
    slot_s = (output - 1) * step_s / limit  # decode time per request, its slot shared
    rate = math.inf
    for _ in range(20):
        slowdown = model.host.slowdown(rate * output) if model.host and math.isfinite(rate) else 1.0
        if split.colocated:  # each instance prefills its own requests between decode steps
            bound = CapacityBound(split.decode / (slowdown * (prefill_s + slot_s)), "colocated")
        else:
            by_pool = {
                "prefill": split.prefill / (slowdown * prefill_s),
                "decode": split.decode / (slowdown * slot_s) if slot_s > 0 else math.inf,
            }
            pool = min(by_pool, key=by_pool.__getitem__)
            bound = CapacityBound(by_pool[pool], pool)
        if math.isclose(bound.rate_rps, rate, rel_tol=1e-6):
            break
        rate = bound.rate_rps
    return bound


def max_goodput(model: PerformanceModel, split: Split, workload: Workload, slo: SLO, gpus: int) -> Candidate:
    """Bisection on the arrival rate for the highest sustainable rate that meets the SLO."""
    passing: Summary | None = None
    peak_batch = 0
    capacity = capacity_bound(model, split, workload)

    def attains(rate: float) -> bool:
        nonlocal passing, peak_batch
        if rate > capacity.rate_rps:
            return False  # not sustainable: the queue grows without bound
        timeline = simulate(model, split, workload, rate)
        peak_batch = max(peak_batch, timeline.peak_batch)
        if timeline.meets(slo).mean() < slo.attainment_target:
            return False
        passing = timeline.summary(rate, slo)
        return True

    low, high = 0.0, float(capacity_estimate(model, split, workload))
    if attains(capacity.rate_rps):  # meets the SLO right up to capacity: that is the goodput
        return Candidate(
            split, capacity.rate_rps, capacity.rate_rps / gpus, passing, peak_batch >= split.batch_limit, capacity
        )
    high = min(high, capacity.rate_rps)
    for _ in range(MAX_DOUBLINGS):
        if not attains(high):
            break
        low, high = high, 2 * high
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if attains(middle) else (low, middle)
    # The last pass was at `low`.
    return Candidate(split, low, low / gpus, passing, peak_batch >= split.batch_limit, capacity)


def _split_candidates(
    model: PerformanceModel, workload: Workload, slo: SLO, space: SearchSpace, prefill: int
) -> list[Candidate]:
    candidates: list[Candidate] = []
    for limit in sorted(space.batch_limits):
        split = Split(prefill, space.instances - prefill, limit, space.token_budget)
        if candidates and not candidates[-1].limit_reached:
            # No simulation filled the smaller limit: from the same bracket a larger one
            # replays the same simulations, so the same bisection.
            candidates.append(replace(candidates[-1], split=split))
        else:
            candidates.append(max_goodput(model, split, workload, slo, space.gpus))
    return candidates


def search(model: PerformanceModel, workload: Workload, slo: SLO, space: SearchSpace) -> SearchResult:
    space = space.sized_for(model)
    candidates = [c for prefill in space.splits() for c in _split_candidates(model, workload, slo, space, prefill)]
    return SearchResult(slo, space, tuple(candidates))


def best_of(
    model: PerformanceModel,
    workload: Workload,
    slo: SLO,
    splits: Sequence[Split],
    incumbent: Split,
    gpus_per_instance: int = 1,
) -> tuple[Candidate, Candidate]:
    """The incumbent's candidate and the best among it and `splits` (the incumbent unless
    one beats it strictly): what a planner needs, without the whole table. A split is
    simulated only while its capacity bound exceeds the best goodput found so far, since
    goodput never exceeds capacity; highest capacity first, so the likely winner raises the
    bar early and most of the others are never simulated."""

    def evaluate(split: Split) -> Candidate:
        return max_goodput(model, split, workload, slo, split.instances * gpus_per_instance)

    mine = best = evaluate(incumbent)
    bounds = [(capacity_bound(model, p, workload).rate_rps, p) for p in splits if p != incumbent]
    for bound, split in sorted(bounds, key=lambda pair: -pair[0]):
        if bound <= best.goodput_rps:
            break  # in decreasing order: none of the rest can win either
        candidate = evaluate(split)
        if candidate.goodput_rps > best.goodput_rps:
            best = candidate
    return mine, best
