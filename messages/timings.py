"""Per-request phase timings, measured where each phase happens, and the one percentile
definition and SLO type that the router, the load generator and the simulator all use (a
stream's final p99 and the load generator's p99 of the same gaps are the same number)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from configuration.fields import knob
from messages.transfer import TransferBytes


def percentile(values: Sequence[float], q: float, presorted: bool = False) -> float:
    """q-th percentile, linear interpolation between closest ranks (numpy's default)."""
    ordered = values if presorted else sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (position - low))


ItlStat = Literal["mean", "p90"]


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = knob(flag="ttft-slo", help="time to first token, seconds")
    itl_s: float = knob(flag="itl-slo", help="a request's inter-token time, seconds")
    percentile: float = knob(90.0, help="attainment target: % of requests that must meet both SLOs")
    # "mean" is DistServe's TPOT (the simulator's only statistic).
    itl_stat: ItlStat = knob("mean", help="a request's inter-token time: the mean or the p90 of its gaps")

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")

    @property
    def attainment_target(self) -> float:
        return self.percentile / 100


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Mean, p50/p90/p99 and max of some latencies in seconds (None for no samples): one type
    for a stream's final message, the load generator's report and the simulator's."""

    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, samples: Sequence[float]) -> LatencySummary:
        if not len(samples):
            return cls(None, None, None, None, None)
        ordered = sorted(float(x) for x in samples)
        p50, p90, p99 = (percentile(ordered, q, presorted=True) for q in (50, 90, 99))
        return cls(sum(ordered) / len(ordered), p50, p90, p99, ordered[-1])


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    queue_s: float  # router arrival -> prefill engine starts, and its answer back (routing, the feed)
    prefill_s: float  # prefill engine: prompt in -> blocks ready for transfer
    transfer_s: float  # prefill done -> decode's first token: NIXL pull of KV + state, one step
    ttft_s: float  # router arrival -> first token at the router
    inter_token: LatencySummary
    decode_tokens_per_s: float  # after the first token
    e2e_s: float
    transfer_bytes: TransferBytes


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One finished request as a router measured it (what the closed-loop planner observes);
    `arrival_s` on the wall clock, comparable between processes."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_s: float  # the request's mean inter-token time (TPOT); 0 for a one-token output
    cached_tokens: int = 0  # of the prompt, served from a prefix cache

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.ttft_s < 0 or self.itl_s < 0:
            raise ValueError(f"invalid finished request {self}: token counts >= 1, latencies >= 0")
        if not 0 <= self.cached_tokens < self.prompt_tokens:
            raise ValueError(f"invalid finished request {self}: cached tokens in [0, prompt tokens)")
