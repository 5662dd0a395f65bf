"""The orchestrator's choices as records: where a leg prefills, what becomes of a stream
whose decode engine died, the prefill's in-flight count undone however the call ends, and a
prefill left behind (timed out, or its caller gone) aborted or its blocks freed.

Fast unit tests on stand-in pools and actors (real feeds on loopback, tests/feed_actors.py);
the real paths (a killed actor mid-stream, no live prefill engine, deadlines anywhere in a
request) run in test_faults.py and test_front_door.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray.exceptions import ActorDiedError

from cluster.pools import Member, Pool
from feed_actors import FeedActor, Method
from messages.errors import NoWorkerError, PrefillTimeoutError
from messages.membership import Lifecycle
from messages.reports import PrefixHit
from messages.requests import GenerateRequest, ModelLimits, SamplingConfig
from router.orchestrator import Orchestrator, RouterPolicy

REQUEST = GenerateRequest("r-1", tuple(range(1, 17)), SamplingConfig(max_tokens=2))


class _DeadActor:
    """An actor Ray says is gone when a router asks where its feed is."""

    def __init__(self) -> None:
        self.calls = 0
        self.feed_address = Method(self._gone)
        self.renew_feed = Method(lambda *args: None)

    async def _gone(self):  # noqa: ANN202
        self.calls += 1
        raise ActorDiedError()


def _prefill(answers: bool = True) -> FeedActor:
    """A prefill actor on a real feed: it answers each prefill at once, or never."""
    actor = FeedActor()
    if answers:
        actor.prefill_gate.set()
    return actor


def _orchestrator(*prefill_actors, policy: RouterPolicy = RouterPolicy()) -> Orchestrator:  # noqa: ANN002
    """Routing blind to prefix caches: these stand-ins have no index to follow (decisions by
    what engines hold take their answers as arguments)."""
    policy = dataclasses.replace(policy, cache_aware=False)
    members = [Member(f"prefill-{i}", actor) for i, actor in enumerate(prefill_actors)]
    for member in members:
        member.mark_live()
    decode = Pool("decode", [Member("decode-0", None)])
    return Orchestrator(Pool("prefill", members), decode, ModelLimits(max_model_len=64, vocab_size=100), policy)


def test_where_a_leg_prefills_and_why():
    remote = _orchestrator(_prefill())
    plan = remote.plan_prefill(REQUEST)
    assert plan.reason == "prefill pool" and plan.route.member.name == "prefill-0"
    assert plan.route.reason == "only live member"
    short = GenerateRequest("r-2", (1, 2), SamplingConfig(max_tokens=2))
    assert remote.plan_prefill(short).route is None and remote.plan_prefill(short).reason == "short prompt"
    colocated = Orchestrator(Pool("prefill"), Pool("decode"), ModelLimits(64, 100))
    assert colocated.plan_prefill(REQUEST).reason == "colocated"
    remote.prefill.members[0].mark_dead("test")
    assert remote.plan_prefill(REQUEST).reason == "no live prefill engine"  # policy "local": degraded
    strict = _orchestrator(_prefill(), policy=RouterPolicy(on_prefill_unavailable="fail"))
    strict.prefill.members[0].mark_dead("test")
    with pytest.raises(NoWorkerError):
        strict.plan_prefill(REQUEST)


def test_a_decode_engine_holding_all_but_a_few_tokens_prefills_them_itself():
    policy = RouterPolicy(local_prefill_uncached=4)
    orchestrator = _orchestrator(_prefill(), policy=policy)
    decode = [Member(f"decode-{i}", None) for i in range(2)]
    for member in decode:
        member.mark_live()
    orchestrator.decode = Pool("decode", decode)
    # 16 prompt tokens: decode-1 lacks 4 of them, decode-0 all.
    plan = orchestrator.plan_prefill(REQUEST, {}, {"decode-0": PrefixHit(), "decode-1": PrefixHit(12, 12)})
    assert plan.reason == "cached on decode" and plan.route is None
    assert plan.decode.member.name == "decode-1" and plan.decode.cached_tokens == 12
    short_of_it = {"decode-0": PrefixHit(), "decode-1": PrefixHit(11, 11)}
    assert orchestrator.plan_prefill(REQUEST, {}, short_of_it).reason == "prefill pool"
    # A prompt no longer than the limit needs no hit: computing it costs less than a handoff.
    four = GenerateRequest("r-3", (1, 2, 3, 4), SamplingConfig(max_tokens=2))
    assert orchestrator.plan_prefill(four).reason == "short prompt"
    # Off (the default without a planner model): the prefill pool, whatever decode holds.
    off = _orchestrator(_prefill())
    off.decode = orchestrator.decode
    all_of_it = {"decode-0": PrefixHit(16, 16), "decode-1": PrefixHit(16, 16)}
    assert off.plan_prefill(REQUEST, {}, all_of_it).reason == "prefill pool"


def test_a_decode_engine_that_computes_the_prompt_is_picked_by_prefill_work():
    """Colocated, decode-0 is computing a 1,000-token prompt and decode-1 decodes two streams:
    by requests decode-0 would win and the prompt would wait behind that prefill."""
    orchestrator = Orchestrator(Pool("prefill"), Pool("decode"), ModelLimits(64, 100), RouterPolicy(cache_aware=False))
    orchestrator.decode = Pool("decode", [Member(f"decode-{i}", None) for i in range(2)])
    prefilling, decoding = orchestrator.decode.members
    for member in orchestrator.decode.members:
        member.mark_live()
    plan = orchestrator.plan_prefill(REQUEST)

    async def scenario() -> list[str]:
        async with orchestrator.decode.in_flight(prefilling, prompt_tokens=1000):
            async with orchestrator.decode.in_flight(decoding), orchestrator.decode.in_flight(decoding):
                local = await orchestrator._decode_route(REQUEST, plan, handed_off=False)
                handoff = await orchestrator._decode_route(REQUEST, plan, handed_off=True)
        return [local.member.name, handoff.member.name]

    assert asyncio.run(scenario()) == ["decode-1", "decode-0"]  # a handoff's leg goes by requests


def test_a_dead_decode_engine_migrates_the_stream_until_the_policy_says_fail():
    orchestrator = _orchestrator(policy=RouterPolicy(max_migrations=2))
    assert [orchestrator.failover(n).action for n in range(3)] == ["migrate", "migrate", "fail"]
    assert "max_migrations is 2" in orchestrator.failover(2).reason
    never = _orchestrator(policy=RouterPolicy(on_decode_failure="fail"))
    assert never.failover(0).action == "fail" and "policy" in never.failover(0).reason


def test_a_structured_output_streamed_in_part_is_not_migrated():
    """Its grammar's state died with the engine: resumed elsewhere it would restart mid-output."""
    orchestrator = _orchestrator(policy=RouterPolicy(max_migrations=2))
    failover = orchestrator.failover(0, grammar_started=True)
    assert failover.action == "fail" and "structured output" in failover.reason


def test_a_prefill_engine_that_dies_is_marked_and_the_leg_planned_again():
    dying, healthy = _DeadActor(), _prefill()
    orchestrator = _orchestrator(dying, healthy)
    first, second = orchestrator.prefill.members

    async def scenario():  # noqa: ANN202
        async with orchestrator.prefill.in_flight(second, prompt_tokens=1000):  # busier: the dying one goes first
            return await orchestrator._prefill_or_local(REQUEST)

    member, result, plan = asyncio.run(scenario())
    assert result.handle.request_id.startswith("r-1") and member is second and plan.route.member is second
    assert (dying.calls, healthy.prefills) == (1, 1)
    assert first.lifecycle is Lifecycle.DEAD
    assert [(m.outstanding_requests, m.outstanding_prompt_tokens) for m in orchestrator.prefill.members] == [(0, 0)] * 2


def test_a_cancelled_prefill_is_no_longer_counted():
    orchestrator = _orchestrator(_prefill(answers=False))
    member = orchestrator.prefill.members[0]

    async def scenario() -> None:
        leg = asyncio.ensure_future(orchestrator._prefill_or_local(REQUEST))
        while member.outstanding_requests == 0:
            await asyncio.sleep(0.001)
        assert member.outstanding_prompt_tokens == len(REQUEST.prompt_token_ids)
        leg.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await leg

    asyncio.run(scenario())
    assert (member.outstanding_requests, member.outstanding_prompt_tokens) == (0, 0)
    assert member.live  # leaving is the client's doing, not the engine's


def test_a_timed_out_prefill_is_aborted_and_a_left_one_frees_its_blocks_when_it_ends():
    """Timed out: the actor stops the leg, and nothing is left to free. The caller gone (a
    prefill is often one engine step, which completes anyway): its result, when it comes,
    names the blocks the router has freed at once rather than at the lease's end."""
    stuck, slow = _prefill(answers=False), _prefill(answers=False)
    timing_out = _orchestrator(stuck, policy=RouterPolicy(prefill_timeout_s=0.2))
    left = _orchestrator(slow)
    freed = []
    timing_out._release_soon = left._release_soon = freed.append

    async def scenario():  # noqa: ANN202
        with pytest.raises(PrefillTimeoutError, match="prefill-0 did not finish within 0s"):
            await timing_out._prefill_or_local(REQUEST)
        while not stuck.closed:
            await asyncio.sleep(0.01)
        aborted = (list(stuck.closed), list(freed))
        leg = asyncio.ensure_future(left._prefill_or_local(REQUEST))
        while slow.prefills == 0:
            await asyncio.sleep(0.01)
        leg.cancel()  # the client left
        await asyncio.gather(leg, return_exceptions=True)
        slow.prefill_gate.set()
        while not freed:
            await asyncio.sleep(0.01)
        return aborted

    (aborted, freed_then) = asyncio.run(scenario())
    assert len(aborted) == 1 and aborted[0].startswith("r-1") and freed_then == []
    (handle,) = freed
    assert handle.request_id == slow.closed[0]  # the left leg's own blocks
    assert timing_out.prefill.members[0].live and left.prefill.members[0].live
