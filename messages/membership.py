"""The pools as the controller publishes them to routers: who is in each pool, where each
engine is in its lifecycle, and its latest load report; and the resizes asked of it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from messages.reports import EngineCapacity, EngineLoad
from messages.requests import ModelLimits
from messages.timings import FinishedRequest


class Lifecycle(enum.Enum):
    """Where an engine is, as its pool's owner (the controller) records it; only the named
    methods of cluster.pools.Member change it, and only along legal transitions."""

    JOINING = "joining"  # started or restarted: answers, not yet handshaken with the other pool
    LIVE = "live"  # takes traffic
    DRAINING = "draining"  # leaving its pool: finishes its requests, never picked again
    DEAD = "dead"  # a call or load poll failed: out of rotation until it answers again


@dataclass(frozen=True, slots=True)
class MemberState:
    name: str
    actor: Any  # Ray actor handle
    lifecycle: Lifecycle
    load: EngineLoad | None
    capacity: EngineCapacity | None


@dataclass(frozen=True, slots=True)
class ClusterView:
    prefill: tuple[MemberState, ...]  # empty: colocated serving
    decode: tuple[MemberState, ...]
    limits: ModelLimits
    # Bumped by every completed load poll: a router that fetched the same poll twice must
    # not take its loads as new.
    poll: int

    @property
    def colocated(self) -> bool:
        return not self.prefill


@dataclass(frozen=True, slots=True)
class RouterReport:
    """What a router saw since its last report, sent with its next view request: the
    controller's planner observes the live workload through these."""

    finished: tuple[FinishedRequest, ...]
    arrivals: int  # requests that arrived, finished or not


@dataclass(frozen=True, slots=True)
class ScalingDecision:
    """A split asked of the controller, and who asked why (the planner's reason, an operator)."""

    prefill: int
    decode: int
    reason: str
    tensor_parallel: tuple[int, int] | None = None  # (prefill, decode) TP the plan assumes; None: unchecked

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ValueError(f"pool sizes {self.prefill}/{self.decode}: a pool holds 0 or more engines")


@dataclass(frozen=True, slots=True)
class ScalingOutcome:
    """What a resize did: the pool sizes before and after the decision."""

    decision: ScalingDecision
    before: tuple[int, int]  # (prefill, decode) engines
    after: tuple[int, int]

    def __str__(self) -> str:
        (p0, d0), (p1, d1) = self.before, self.after
        return f"resize {p0}P:{d0}D -> {p1}P:{d1}D ({self.decision.reason})"
