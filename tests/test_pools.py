"""Pool health from load polls (a late answer is not a death, a dead actor is), the members'
lifecycle, in-flight counts and pick decisions.

Fast unit tests with stand-in actor handles; the real paths (a killed actor, a SIGSTOPped
one) run in test_faults.py and test_front_door.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import pytest
from ray.exceptions import ActorDiedError

from cluster.pools import LifecycleError, Member, Pool
from messages.errors import NoWorkerError
from messages.membership import Lifecycle, MemberState
from messages.reports import EngineLoad

LOAD = EngineLoad(running=0, waiting=0, held_for_transfer=0, free_blocks=10, total_blocks=10, engine_id="e1")


class _Method:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self):
        async def call():
            if self.answer == "slow":
                await asyncio.sleep(10)
            if isinstance(self.answer, BaseException):
                raise self.answer
            return self.answer

        return call()


class _Actor:
    def __init__(self, answer) -> None:
        self.load = _Method(answer)


def _live(name: str, actor=None, engine_id: str = "") -> Member:  # noqa: ANN001
    member = Member(name, actor, engine_id=engine_id)
    member.mark_live()  # as a handshake leaves it
    return member


def _pool(answer) -> Pool:
    return Pool("decode", [_live("decode-0", _Actor(answer), engine_id="e1")])


def _poll(pool: Pool) -> list[Member]:
    return asyncio.run(pool.refresh_loads(timeout_s=0.01))


def test_a_late_load_report_keeps_the_member_until_timeouts_in_a_row():
    pool = _pool("slow")
    for _ in range(pool.timeouts_before_dead - 1):
        assert _poll(pool) == [] and pool.members[0].live
    _poll(pool)
    assert pool.members[0].lifecycle is Lifecycle.DEAD
    try:
        pool.pick_decode()
    except NoWorkerError as err:
        assert "no live decode actor" in str(err)
    else:
        raise AssertionError("a wedged member was picked")


def test_an_answer_resets_the_count_of_late_polls():
    pool = _pool("slow")
    _poll(pool)
    _poll(pool)
    pool.members[0].actor.load.answer = LOAD
    assert _poll(pool) == [] and pool.members[0].missed_polls == 0 and pool.members[0].live
    pool.members[0].actor.load.answer = "slow"
    _poll(pool)
    assert pool.members[0].live


def test_a_dead_actor_leaves_rotation_at_the_first_poll():
    pool = _pool(ActorDiedError())
    _poll(pool)
    assert pool.members[0].lifecycle is Lifecycle.DEAD
    pool.members[0].actor.load.answer = LOAD  # back (same engine): handshaken again first
    assert _poll(pool) == pool.members and pool.members[0].lifecycle is Lifecycle.JOINING


def test_a_restarted_engine_rejoins_through_the_caller():
    pool = _pool(dataclasses.replace(LOAD, engine_id="e2"))
    assert _poll(pool) == pool.members and pool.members[0].lifecycle is Lifecycle.JOINING  # until handshaken


def test_a_draining_member_is_never_brought_back_by_a_poll():
    pool = _pool(LOAD)
    member = pool.members[0]
    member.mark_draining()
    member.actor.load.answer = dataclasses.replace(LOAD, engine_id="e2")  # even restarted
    assert _poll(pool) == [] and member.lifecycle is Lifecycle.DRAINING
    member.actor.load.answer = ActorDiedError()
    _poll(pool)
    assert member.lifecycle is Lifecycle.DRAINING  # dead or not, it is leaving


def test_only_a_handshake_makes_a_member_live():
    for path in ([], ["mark_dead"], ["mark_draining"], ["mark_dead", "mark_draining"]):
        member = Member("decode-0", None)
        for step in path:
            getattr(member, step)(*(["test"] if step == "mark_dead" else []))
        if member.lifecycle is Lifecycle.JOINING:
            member.mark_live()
            assert member.live
            continue
        before = member.lifecycle
        with pytest.raises(LifecycleError, match=f"{before.value} -> live"):
            member.mark_live()
        assert member.lifecycle is before  # a refused transition changes nothing


def test_the_lifecycle_moves_only_along_its_transitions():
    member = Member("decode-0", None)
    assert member.lifecycle is Lifecycle.JOINING and not member.live
    member.mark_live()
    member.mark_dead("load poll failed")
    member.mark_dead("a call failed too")  # one death, reported twice
    assert member.lifecycle is Lifecycle.DEAD
    member.mark_joining()  # answers again
    member.mark_live()
    member.mark_joining()  # restarted under a new engine id
    member.mark_draining()  # a resize takes it out before its handshake
    member.mark_joining()  # moved to the other pool (role switch)
    assert member.lifecycle is Lifecycle.JOINING
    with pytest.raises(AttributeError):
        member.lifecycle = Lifecycle.LIVE  # only the named methods change it


class _InterruptedProducer(_Actor):
    """A live prefill engine whose handshake call runs `meanwhile` (what a resize does while
    the health poll waits on it), then fails."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        super().__init__(dataclasses.replace(LOAD, engine_id="p1"))
        self.prefill = self
        self.meanwhile = meanwhile

    def remote(self, request):  # noqa: ANN001
        self.meanwhile()
        raise RuntimeError("handshake interrupted")


def _handshake_interrupted_by(change: Callable[[Pool, Pool], None]) -> tuple[Pool, Pool]:
    """A joining decode engine, polled and handshaken with a live prefill engine while
    `change(prefill, decode)` runs. Returns the pools after the poll."""
    from controller.health import PoolHealth

    decode = Pool("decode", [Member("decode-0", _Actor(LOAD))])
    prefill = Pool("prefill", [])
    prefill.members.append(_live("prefill-0", _InterruptedProducer(lambda: change(prefill, decode)), engine_id="p1"))
    asyncio.run(PoolHealth(prefill, decode).refresh(poll_timeout_s=1))
    return prefill, decode


def test_a_member_taken_out_during_its_handshake_does_not_become_live():
    """A resize (or a failed call) may change a joining member while the health poll is
    still handshaking it: the poll must not make it live afterwards."""
    prefill, decode = _handshake_interrupted_by(lambda prefill, decode: decode.members[0].mark_draining())
    assert decode.members[0].lifecycle is Lifecycle.DRAINING and prefill.members[0].live


def test_a_member_moved_to_the_other_pool_during_its_handshake_joins_there_anew():
    """A role switch may move a joining decode member to the prefill pool (JOINING again
    there) while the poll handshakes it as a consumer: that poll must not make it live as a
    producer; the prefill pool's next refresh handshakes it in its new role."""

    def switch_roles(prefill: Pool, decode: Pool) -> None:  # as Deployment._switch_roles does
        mover = decode.members[0]
        mover.mark_draining()
        decode.members.remove(mover)
        mover.mark_joining()
        prefill.members.append(mover)

    prefill, decode = _handshake_interrupted_by(switch_roles)
    assert decode.members == [] and prefill.members[1].name == "decode-0"
    assert prefill.members[1].lifecycle is Lifecycle.JOINING


def _route(reports_every: int | None, seed: int, routers: int = 2, actors: int = 4, requests: int = 40) -> int:
    """Long-lived requests arriving at random routers that each pick on their own; every
    `reports_every` arrivals each router gets the engines' load reports (None: never).
    Returns the spread (max - min) of the requests the actors end up with."""
    import random

    rng = random.Random(seed)
    random.seed(seed)  # each pool's tie-break start: deterministic here
    pools = [Pool("decode", [_live(f"decode-{i}") for i in range(actors)]) for _ in range(routers)]

    async def arrive(held: contextlib.AsyncExitStack) -> list[int]:
        for arrival in range(requests):
            if reports_every and arrival % reports_every == 0:
                truth = [sum(p.members[i].outstanding_requests for p in pools) for i in range(actors)]
                for pool in pools:
                    for member, running in zip(pool.members, truth):
                        member.record_load(dataclasses.replace(LOAD, running=running, measured_at=time.time()))
            pool = pools[rng.randrange(routers)]
            await held.enter_async_context(pool.in_flight(pool.pick_decode().member))  # long-lived: held to the end
        return [sum(p.members[i].outstanding_requests for p in pools) for i in range(actors)]

    async def route() -> list[int]:
        async with contextlib.AsyncExitStack() as held:
            return await arrive(held)

    totals = asyncio.run(route())
    return max(totals) - min(totals)


def test_routers_picking_alone_unbalance_the_pool_and_load_reports_even_it():
    """8 routers, 4 decode actors, 32 long requests: each router balances its own few
    requests, but not the sum. With the engines' load reports (running + waiting: every
    router's requests) arriving every 2 arrivals (a 0.5 s poll at 4 req/s), the spread
    stays within 2."""
    alone = [_route(None, seed, routers=8, requests=32) for seed in range(100)]
    reported = [_route(2, seed, routers=8, requests=32) for seed in range(100)]
    print(
        f"spread of requests over 4 actors: routers alone mean {sum(alone) / 100:.2f} max {max(alone)}; "
        f"with load reports mean {sum(reported) / 100:.2f} max {max(reported)}"
    )
    assert max(alone) >= 5 and sum(alone) / 100 > 2
    assert max(reported) <= 2 and sum(reported) / 100 < sum(alone) / 100 / 2


def test_a_mirrored_pool_keeps_its_own_counts_and_takes_loads_only_from_a_new_poll():
    def state(name: str, running: int, lifecycle: Lifecycle = Lifecycle.LIVE) -> MemberState:
        load = dataclasses.replace(LOAD, running=running, measured_at=time.time())
        return MemberState(name, name, lifecycle, load, None)

    async def scenario() -> None:
        pool = Pool("decode")
        pool.mirror((state("decode-0", 0), state("decode-1", 0)), new_poll=True)
        first = pool.members[0]
        async with pool.in_flight(first), pool.in_flight(first):  # this router's own requests, started since that poll
            pool.mirror((state("decode-0", 5), state("decode-1", 1, Lifecycle.DEAD)), new_poll=False)
            assert pool.members[0] is first and first.outstanding_requests == 2
            assert first.load.running == 0  # the same poll again: not news
            assert pool.members[1].lifecycle is Lifecycle.DEAD  # always the controller's latest word
            pool.mirror((state("decode-0", 5), state("decode-1", 1)), new_poll=False)
            assert pool.members[1].live  # dead to live, a view apart: what the controller's transitions led to
            pool.mirror((state("decode-0", 5),), new_poll=True)  # decode-1 left the pool
            assert [m.name for m in pool.members] == ["decode-0"]
            assert first.estimated_requests == 5  # the report already counts this router's 2
            async with pool.in_flight(first):
                assert first.estimated_requests == 6

    asyncio.run(scenario())


def test_a_late_report_still_counts_what_this_router_started_after_it_was_measured():
    """A report reaches a router through the controller up to a poll interval after the
    engine measured it: requests the router started in between are not in it, those it
    started before are, whenever the report arrives."""
    pool = Pool("decode", [_live("decode-0")])
    member = pool.members[0]

    async def scenario() -> None:
        async with pool.in_flight(member):  # started before the measurement: counted in `running`
            measured_at = time.time()
            time.sleep(0.001)
            async with pool.in_flight(member):  # started after it, before the report arrives
                # 3 others' + our first
                member.record_load(dataclasses.replace(LOAD, running=4, measured_at=measured_at))
                assert member.estimated_requests == 5
            assert member.estimated_requests == 4  # one of ours finished since
            time.sleep(0.001)
            # A newer report has it all.
            member.record_load(dataclasses.replace(LOAD, running=4, measured_at=time.time()))
            assert member.estimated_requests == 4

    asyncio.run(scenario())


def test_a_decode_report_counts_this_routers_requests_once_however_late_they_reached_the_engine():
    """A decode leg is counted here before the engine has it (the request crosses the feed,
    the engine takes it at its next step). A report measured in between, by time alone,
    would drop the request from this router's count though the engine's count lacks it too:
    the engine would look one request lighter (two routers then piled 4:2 on two engines
    in CI). The report names this router's feed's requests instead, and the other routers'
    feeds': a leg in a feed before the engine has it must not hide another router's request
    (tests/test_routers.py's balance test once ended 2:4, which this window fits)."""
    pool = Pool("decode", [_live("decode-0")])
    member = pool.members[0]
    member.feed = "router-a-feed"

    async def scenario() -> None:
        async with pool.in_flight(member):
            time.sleep(0.001)
            # Measured after the router counted it, before the engine had it: 2 others'.
            member.record_load(dataclasses.replace(LOAD, running=2, measured_at=time.time()))
            assert member.estimated_requests == 3
            feeds = (("router-a-feed", 1), ("router-b-feed", 2))
            # In this router's feed, not yet taken by the engine: still 2 others' (router b's),
            # not the engine's 2 less this router's 1.
            member.record_load(dataclasses.replace(LOAD, running=2, measured_at=time.time(), requests_by_feed=feeds))
            assert member.estimated_requests == 3
            # The engine has it now: 2 others' and this router's 1.
            member.record_load(dataclasses.replace(LOAD, running=3, measured_at=time.time(), requests_by_feed=feeds))
            assert member.estimated_requests == 3
        # Finished here, still on the engine's last report: the others' 2 remain.
        assert member.estimated_requests == 2

    asyncio.run(scenario())


def test_an_engine_switched_to_prefill_keeps_no_decode_feed():
    """A router's feed counts its decode legs; in the prefill pool, counted by that feed, the
    router's prefill calls (not feed legs) would count twice, in its own count and the report's."""
    from controller.deployment import Deployment, DeploymentConfig
    from vllm_engine.config import EngineConfig

    config = DeploymentConfig(engine=EngineConfig(model="m"), num_decode=2, switch_roles=True, drain_quiet_s=0)
    deployment = Deployment(config)
    mover, staying = _live("engine-1", _Actor(LOAD)), _live("engine-2", _Actor(LOAD))
    mover.feed = staying.feed = "router-a-feed"
    deployment.prefill.members = [_live("engine-0", _Actor(LOAD))]
    deployment.decode.members = [mover, staying]
    asyncio.run(deployment._switch_roles(num_prefill=2, num_decode=1, drain_timeout_s=1))
    assert deployment.prefill.members[1] is mover and mover.feed is None
    assert deployment.decode.members == [staying] and staying.feed == "router-a-feed"


def test_in_flight_counts_always_come_back_down():
    pool = Pool("prefill", [_live("prefill-0")])
    member = pool.members[0]

    async def raises() -> None:
        async with pool.in_flight(member, prompt_tokens=100):
            assert (member.outstanding_requests, member.outstanding_prompt_tokens) == (1, 100)
            raise RuntimeError("the call failed")

    async def cancelled() -> None:
        entered = asyncio.Event()

        async def held() -> None:
            async with pool.in_flight(member, prompt_tokens=7):
                entered.set()
                await asyncio.sleep(60)

        task = asyncio.ensure_future(held())
        await entered.wait()
        assert (member.outstanding_requests, member.outstanding_prompt_tokens) == (1, 7)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def stream():  # noqa: ANN202 (a leg's generator that its caller leaves early)
        async with pool.in_flight(member, prompt_tokens=3):
            for token in range(10):
                yield token

    async def left_early() -> None:
        tokens = stream()
        assert await anext(tokens) == 0 and member.outstanding_requests == 1
        await tokens.aclose()

    async def prefilled() -> None:  # a leg's prompt stops counting at its first token
        async with pool.in_flight(member, prompt_tokens=50) as counted:
            counted.prefilled()
            assert (member.outstanding_requests, member.outstanding_prompt_tokens) == (1, 0)

    with pytest.raises(RuntimeError):
        asyncio.run(raises())
    for scenario in (cancelled, left_early, prefilled):
        asyncio.run(scenario())
    assert (member.outstanding_requests, member.outstanding_prompt_tokens) == (0, 0)
    assert member.estimated_requests == 0


def test_a_pick_says_whom_and_why():
    pool = Pool("decode", [_live("decode-0"), _live("decode-1"), Member("decode-2", None)])
    pool.members[0].record_load(dataclasses.replace(LOAD, running=3, free_blocks=4))
    pool.members[1].record_load(dataclasses.replace(LOAD, running=1, free_blocks=8))
    pick = pool.pick_decode()
    assert (pick.pool, pick.member.name, pick.reason, pick.live) == ("decode", "decode-1", "least loaded", 2)
    assert (pick.requests, pick.free_blocks) == (1, 8)
    assert "decode-1" in str(pick) and "least loaded" in str(pick)
    pool.members[0].record_load(dataclasses.replace(LOAD, running=1, free_blocks=8))
    assert pool.pick_decode().reason == "tie, taken in turn"
    pool.members[0].mark_dead("test")
    assert pool.pick_decode().reason == "only live member"
    with pytest.raises(dataclasses.FrozenInstanceError):
        pick.reason = "least loaded"  # type: ignore[misc]


def test_a_journal_hands_over_what_finished_since_the_last_report():
    from messages.results import GenerationResult
    from messages.timings import LatencySummary, PhaseTimings
    from messages.transfer import TransferBytes
    from router.journal import RequestJournal

    def result(tokens: int, rate: float) -> GenerationResult:
        timings = PhaseTimings(0, 0, 0, 0.25, LatencySummary.of([]), rate, 1.0, TransferBytes(0, 0))
        return GenerationResult("length", 100, tokens, timings, "prefill-0", "decode-0")

    journal = RequestJournal()
    arrived = journal.arrived()
    journal.arrived()  # one still running
    journal.finished(arrived, result(10, rate=50.0))
    journal.finished(arrived, result(0, rate=0.0))  # nothing generated: nothing to observe
    report = journal.take()
    assert report.arrivals == 2 and len(report.finished) == 1
    (done,) = report.finished
    assert (done.prompt_tokens, done.output_tokens, done.ttft_s, done.itl_s) == (100, 10, 0.25, 0.02)
    assert journal.take().finished == () and journal.take().arrivals == 0


def test_a_member_moved_out_during_a_poll_leaves_the_others_their_own_loads():
    """A role switch takes a member out of the pool while a load poll is out (the controller
    polls and resizes concurrently): each report still goes to the member it came from, and
    the one that left is not counted as joining this pool."""
    answered = asyncio.Event()

    class _Gated:
        def __init__(self, load: EngineLoad) -> None:
            self.load = self
            self.answer = load

        def remote(self):
            async def call():
                await answered.wait()
                return self.answer

            return call()

    leaving = _live("engine-0", _Gated(dataclasses.replace(LOAD, engine_id="e0")), engine_id="e0")
    staying = _live("engine-1", _Gated(LOAD), engine_id="e1")
    pool = Pool("decode", [leaving, staying])

    async def poll_while_one_moves() -> list[Member]:
        poll = asyncio.ensure_future(pool.refresh_loads(timeout_s=5))
        await asyncio.sleep(0)
        pool.members.remove(leaving)  # as _switch_roles does
        leaving.mark_draining()
        answered.set()
        return await poll

    assert asyncio.run(poll_while_one_moves()) == []
    assert staying.live and staying.engine_id == "e1" and pool.pick_decode().member is staying
