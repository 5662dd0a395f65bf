"""Pool health from load polls: a late answer is not a death, a dead actor is.

Fast unit tests with stand-in actor handles; the real paths (a killed actor, a SIGSTOPped
one) run in test_faults.py and test_front_door.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from ray.exceptions import ActorDiedError

from messages.errors import NoWorkerError
from messages.reports import EngineLoad
from cluster.pools import Member, Pool

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


def _pool(answer) -> Pool:
    return Pool("decode", [Member("decode-0", _Actor(answer), alive=True, engine_id="e1")])


def _poll(pool: Pool) -> list[Member]:
    return asyncio.run(pool.refresh_loads(timeout_s=0.01))


def test_a_late_load_report_keeps_the_member_until_timeouts_in_a_row():
    pool = _pool("slow")
    for _ in range(pool.timeouts_before_dead - 1):
        assert _poll(pool) == [] and pool.members[0].alive
    _poll(pool)
    assert not pool.members[0].alive
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
    assert _poll(pool) == [] and pool.members[0].missed_polls == 0 and pool.members[0].alive
    pool.members[0].actor.load.answer = "slow"
    _poll(pool)
    assert pool.members[0].alive


def test_a_dead_actor_leaves_rotation_at_the_first_poll():
    pool = _pool(ActorDiedError())
    _poll(pool)
    assert not pool.members[0].alive


def test_a_restarted_engine_rejoins_through_the_caller():
    pool = _pool(dataclasses.replace(LOAD, engine_id="e2"))
    assert _poll(pool) == pool.members and not pool.members[0].alive  # until handshaken


def _route(reports_every: int | None, seed: int, routers: int = 2, actors: int = 4, requests: int = 40) -> int:
    """Long-lived requests arriving at random routers that each pick on their own; every
    `reports_every` arrivals each router gets the engines' load reports (None: never).
    Returns the spread (max - min) of the requests the actors end up with."""
    import random

    rng = random.Random(seed)
    random.seed(seed)  # each pool's tie-break start: deterministic here
    pools = [Pool("decode", [Member(f"decode-{i}", None, alive=True) for i in range(actors)]) for _ in range(routers)]
    for arrival in range(requests):
        if reports_every and arrival % reports_every == 0:
            truth = [sum(p.members[i].outstanding_requests for p in pools) for i in range(actors)]
            for pool in pools:
                for member, running in zip(pool.members, truth):
                    member.record_load(dataclasses.replace(LOAD, running=running, measured_at=time.time()))
        pool = pools[rng.randrange(routers)]
        pool.pick_decode().outstanding_requests += 1
    totals = [sum(p.members[i].outstanding_requests for p in pools) for i in range(actors)]
    return max(totals) - min(totals)


def test_routers_picking_alone_unbalance_the_pool_and_load_reports_even_it():
    """8 routers, 4 decode actors, 32 long requests: each router balances its own few
    requests, but not the sum. With the engines' load reports (running + waiting: every
    router's requests) arriving every 2 arrivals (a 0.5 s poll at 4 req/s), the spread
    stays within 2."""
    alone = [_route(None, seed, routers=8, requests=32) for seed in range(100)]
    reported = [_route(2, seed, routers=8, requests=32) for seed in range(100)]
    print(f"spread of requests over 4 actors: routers alone mean {sum(alone) / 100:.2f} max {max(alone)}; "
          f"with load reports mean {sum(reported) / 100:.2f} max {max(reported)}")
    assert max(alone) >= 5 and sum(alone) / 100 > 2
    assert max(reported) <= 2 and sum(reported) / 100 < sum(alone) / 100 / 2


def test_a_mirrored_pool_keeps_its_own_counts_and_takes_loads_only_from_a_new_poll():
    from messages.membership import MemberState

    def state(name: str, running: int, alive: bool = True) -> MemberState:
        return MemberState(name, name, alive, False, dataclasses.replace(LOAD, running=running, measured_at=time.time()), None)

    pool = Pool("decode")
    pool.mirror((state("decode-0", 0), state("decode-1", 0)), new_poll=True)
    first = pool.members[0]
    first.outstanding_requests = 2  # this router's own requests, started since that poll
    pool.mirror((state("decode-0", 5), state("decode-1", 1, alive=False)), new_poll=False)
    assert pool.members[0] is first and first.outstanding_requests == 2
    assert first.load.running == 0  # the same poll again: not news
    assert not pool.members[1].alive  # liveness is always the controller's latest word
    pool.mirror((state("decode-0", 5),), new_poll=True)  # decode-1 left the pool
    assert [m.name for m in pool.members] == ["decode-0"]
    assert first.estimated_requests == 5  # the report already counts this router's 2
    first.outstanding_requests += 1
    assert first.estimated_requests == 6


def test_a_late_report_still_counts_what_this_router_started_after_it_was_measured():
    """A report reaches a router through the controller up to a poll interval after the
    engine measured it: requests the router started in between are not in it, those it
    started before are, whenever the report arrives."""
    member = Member("decode-0", None, alive=True)
    member.outstanding_requests += 1  # started before the measurement: counted in `running`
    measured_at = time.time()
    time.sleep(0.001)
    member.outstanding_requests += 1  # started after it, before the report arrives
    member.record_load(dataclasses.replace(LOAD, running=4, measured_at=measured_at))  # 3 others' + our first
    assert member.estimated_requests == 5
    member.outstanding_requests -= 1  # one of ours finished since
    assert member.estimated_requests == 4
    time.sleep(0.001)
    member.record_load(dataclasses.replace(LOAD, running=4, measured_at=time.time()))  # a newer report has it all
    assert member.estimated_requests == 4


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
