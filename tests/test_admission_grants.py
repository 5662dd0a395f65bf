"""The router tier's admission limits shared out among routers (controller/admission_grants.py),
and a router's admission following its share as it changes (router/admission.py)."""

from __future__ import annotations

import asyncio
import random

from controller.admission_grants import AdmissionGrants
from messages.membership import AdmissionLimits, RouterAdmission
from router.admission import AdmissionController

LIMITS = AdmissionLimits(max_in_flight=16, max_queue=8)


def report(router: str, in_flight: int = 0, waiting: int = 0) -> RouterAdmission:
    return RouterAdmission(router, in_flight, waiting, LIMITS)


def test_one_router_gets_all_of_the_limits():
    assert AdmissionGrants().grant(report("r0"), now=0.0) == LIMITS


def test_idle_routers_share_the_limits_out_whole():
    grants = AdmissionGrants()
    names = [f"r{i}" for i in range(4)]
    for t in range(3):
        held = {name: grants.grant(report(name), now=float(t)) for name in names}
    assert sum(g.max_in_flight for g in held.values()) == LIMITS.max_in_flight
    assert sum(g.max_queue for g in held.values()) == LIMITS.max_queue
    assert {g.max_in_flight for g in held.values()} == {4}


def test_the_router_with_the_traffic_gets_most_of_it():
    grants = AdmissionGrants()
    for t in range(3):
        for name in ("r1", "r2", "r3"):
            grants.grant(report(name), now=float(t))
        busy = grants.grant(report("r0", in_flight=4, waiting=12), now=float(t))
    assert busy.max_in_flight >= 12, busy


def test_grants_never_add_up_to_more_than_the_limits_whatever_the_order():
    """Routers report in random order and hold anything up to their grant meanwhile."""
    rng = random.Random(7)
    grants = AdmissionGrants()
    granted = {f"r{i}": AdmissionLimits(0, 0) for i in range(4)}
    for step in range(5_000):
        name = rng.choice(sorted(granted))
        held = granted[name]
        in_flight, waiting = rng.randint(0, held.max_in_flight), rng.randint(0, held.max_queue + 20)
        granted[name] = grants.grant(report(name, in_flight, min(waiting, held.max_queue)), now=step * 0.01)
        assert sum(g.max_in_flight for g in granted.values()) <= LIMITS.max_in_flight, (step, granted)
        # Past a router's one place in line (which each has), the queue is shared out whole.
        assert sum(max(0, g.max_queue - 1) for g in granted.values()) <= LIMITS.max_queue, (step, granted)


def test_a_router_that_stops_reporting_stops_counting():
    grants = AdmissionGrants(expiry_s=5.0)
    assert grants.grant(report("gone", in_flight=10), now=0.0) == LIMITS  # alone: all of it
    assert grants.grant(report("r1"), now=1.0) == AdmissionLimits(0, 1)  # held by "gone" until it expires
    assert grants.grant(report("r1"), now=6.0) == LIMITS
    grants.grant(report("left", in_flight=10), now=7.0)
    grants.forget("left")
    assert grants.grant(report("r1"), now=7.5) == LIMITS


def test_waiters_are_admitted_when_the_share_grows_and_not_handed_slots_past_a_shrunk_one():
    async def scenario() -> list[int]:
        share = AdmissionLimits(1, 4)
        admission = AdmissionController(lambda: share)
        seen = []
        entered = asyncio.Event()

        async def request() -> None:
            async with admission.admitted():
                entered.set()
                await asyncio.sleep(0.05)

        first = asyncio.create_task(request())
        await entered.wait()
        waiters = [asyncio.create_task(request()) for _ in range(3)]
        await asyncio.sleep(0.01)
        seen.append(admission.in_flight)  # 1: the others wait
        share = AdmissionLimits(3, 4)
        admission.limits_changed()
        seen.append(admission.in_flight)  # 3: two waiters admitted at once
        share = AdmissionLimits(1, 4)  # shrunk below what is in flight
        await first
        seen.append(admission.in_flight)  # 2: the finished slot was not handed on
        await asyncio.gather(*waiters)
        seen.append(admission.in_flight)
        return seen

    assert asyncio.run(scenario()) == [1, 3, 2, 0]


def test_the_first_router_of_a_starting_tier_leaves_room_for_the_others():
    grants = AdmissionGrants()
    first = grants.grant(RouterAdmission("r0", 0, 0, LIMITS, routers=4), now=0.0)
    assert first == AdmissionLimits(4, 2)
    later = [grants.grant(RouterAdmission(f"r{i}", 0, 0, LIMITS, routers=4), now=0.1) for i in (1, 2, 3)]
    assert all(g.max_in_flight == 4 for g in later) and sum(g.max_queue for g in [first, *later]) == LIMITS.max_queue


def test_a_router_joining_a_fully_granted_tier_queues_its_first_request_until_room_is_made():
    """The router that ran alone holds the whole of the limits when another joins: the
    newcomer's first request waits in line, is not refused, and runs once the first
    router's next report has shrunk its share."""

    async def scenario() -> tuple[AdmissionLimits, AdmissionLimits]:
        grants = AdmissionGrants()
        assert grants.grant(report("first"), now=0.0) == LIMITS
        share = joined = grants.grant(report("new"), now=0.1)
        admission = AdmissionController(lambda: share)
        request = asyncio.create_task(_hold(admission))
        await asyncio.sleep(0.01)
        assert (admission.in_flight, admission.waiting) == (0, 1)  # in line, not refused
        grants.grant(report("first"), now=0.2)  # the newcomer now counts
        share = grants.grant(report("new", waiting=1), now=0.3)
        admission.limits_changed()
        await asyncio.wait_for(request, 1.0)
        return joined, share

    joined, grown = asyncio.run(scenario())
    assert joined == AdmissionLimits(0, 1) and grown.max_in_flight >= 1, (joined, grown)


async def _hold(admission: AdmissionController) -> None:
    async with admission.admitted():
        await asyncio.sleep(0.01)
