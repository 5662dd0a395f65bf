"""The router tier's admission limits, shared out among its routers.

Each router admits up to the configured in-flight and queue limits; N routers that each
applied them alone would admit N times as much. Here every router, when it asks for a
view, reports what it holds and gets a grant: its share of the limits, in proportion to
its demand (what it holds and queues, plus one; routers of the tier yet to report count
as idle), never less than it holds, never more than the other routers leave. A grant
counts against the others until that router's next report replaces it, so the grants
never add up to more than the limits, whatever the order of the reports; traffic that
reaches one router more than the others moves the shares within a view interval. It is
not a lock per request: a router decides alone between two views.

One exception: where the tier has a queue, every router may queue at least one request,
even when the others' grants leave nothing. A router that joins while the others hold the
whole of the limits (or while a dead router's grant has yet to expire) would otherwise
refuse its first requests on an idle tier; with one place in line they wait for the next
view, when the others' shares have shrunk to make room. The tier's queue can so hold up to
one request more per router than its limit; nothing past the in-flight limit runs.

A router that stops reporting (dead, cut off, drained) stops counting after `expiry_s`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from messages.membership import AdmissionLimits, RouterAdmission


@dataclass(frozen=True, slots=True)
class _Holding:
    report: RouterAdmission
    grant: AdmissionLimits
    at: float


class AdmissionGrants:
    def __init__(self, expiry_s: float = 5.0) -> None:
        self._expiry_s = expiry_s
        self._holdings: dict[str, _Holding] = {}

    def grant(self, report: RouterAdmission, now: float) -> AdmissionLimits:
        """The limits `report.router` may admit up to until its next report."""
        self._holdings = {
            name: h for name, h in self._holdings.items() if now - h.at <= self._expiry_s and name != report.router
        }
        others = list(self._holdings.values())
        demand = report.in_flight + report.waiting + 1
        yet_to_report = max(0, report.routers - 1 - len(others))  # a starting tier: each counts as idle
        weight = demand / (demand + sum(h.report.in_flight + h.report.waiting + 1 for h in others) + yet_to_report)
        limits = report.limits
        in_flight = sum(
            _reserved(h.grant.max_in_flight, h.report.in_flight, h.report.limits.max_in_flight, limits.max_in_flight)
            for h in others
        )
        waiting = sum(
            _reserved(h.grant.max_queue, h.report.waiting, h.report.limits.max_queue, limits.max_queue) for h in others
        )
        queue_floor = 1 if limits.max_queue else 0
        granted = AdmissionLimits(
            _share(limits.max_in_flight, report.in_flight, in_flight, weight),
            max(queue_floor, _share(limits.max_queue, report.waiting, waiting, weight)),
        )
        self._holdings[report.router] = _Holding(report, granted, now)
        return granted

    def forget(self, router: str) -> None:
        """A router left: its holding counts no more."""
        self._holdings.pop(router, None)


def _reserved(granted: int, held: int, limit_then: int, limit_now: int) -> int:
    """What another router may hold now: its grant, scaled down if the limits shrank since
    (an engine left: the tier is over its new capacity anyway), and at least what it held."""
    return max(held, granted if limit_now >= limit_then else granted * limit_now // max(1, limit_then))


def _share(limit: int, held: int, held_by_others: int, weight: float) -> int:
    """A router's part of `limit`: its weighted share, but no less than it holds and no more
    than the other routers leave."""
    return max(held, min(math.ceil(limit * weight), limit - held_by_others))
