"""The pools as the controller publishes them to routers: who is in each pool, whether it
takes traffic, and its latest load report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from messages.reports import EngineCapacity, EngineLoad
from messages.requests import ModelLimits
from messages.timings import FinishedRequest


@dataclass(frozen=True, slots=True)
class MemberState:
    name: str
    actor: Any  # Ray actor handle
    alive: bool  # answers, handshaken with the other pool: takes traffic
    draining: bool  # being removed: finishes its requests, never picked again
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
