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
    # The router that asked may hold this much at once (None: all of its own limits).
    admission_grant: AdmissionLimits | None = None

    @property
    def colocated(self) -> bool:
        return not self.prefill


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_in_flight: int  # requests between admission and their final message
    max_queue: int  # requests waiting for a slot (FIFO); past this they are refused


@dataclass(frozen=True, slots=True)
class RouterAdmission:
    """A router's admission counts when it asked for a view, and the tier's limits as its
    configuration sets them: the controller shares the limits out among the routers."""

    router: str
    in_flight: int
    waiting: int
    limits: AdmissionLimits
    routers: int = 1  # routers its tier was started with: those yet to report count too


@dataclass(frozen=True, slots=True)
class RouterReport:
    """What a router saw since its last report, sent with its next view request: the
    controller's planner observes the live workload through these."""

    finished: tuple[FinishedRequest, ...]
    arrivals: int  # requests that arrived, finished or not
    admission: RouterAdmission | None = None


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
