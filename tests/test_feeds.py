"""Worker feeds without engines: batching, aborts and cleanup in FeedHub (vllm_engine/feed.py),
and the feed connection between a router (router/feeds.py) and a FeedServer on loopback,
decode legs' tokens and prefill legs' results. The real path (engine actors on their feeds
to the router) runs in every P/D test."""

import asyncio

import pytest

from vllm_engine.feed import FeedHub
from feed_actors import FeedActor, SilentActor, tokens
from messages.results import LegEvent, StartLeg, TokenChunk


def test_what_is_ready_goes_out_in_one_batch_for_every_request():
    async def scenario():
        hub, step, closed = FeedHub(), asyncio.Event(), []
        feed = hub.stream("router-a")
        first = asyncio.ensure_future(anext(feed))
        await asyncio.sleep(0)
        for name in ("r1", "r2", "r3"):
            hub.start("router-a", name, tokens(step, 2, closed, name))
        step.set()  # both tokens of every request are ready at once
        batch = await first
        await feed.aclose()
        return batch, closed

    batch, closed = asyncio.run(scenario())
    assert sorted(e.leg_id for e in batch) == ["r1", "r1", "r2", "r2", "r3", "r3"]
    assert all(e.error is None for e in batch) and sorted(closed) == ["r1", "r2", "r3"]


def test_closing_a_feed_aborts_its_requests_and_refuses_new_ones():
    async def scenario():
        hub, never, closed = FeedHub(), asyncio.Event(), []
        feed = hub.stream("router-a")
        pending = asyncio.ensure_future(anext(feed))
        await asyncio.sleep(0)
        hub.start("router-a", "r1", tokens(never, 5, closed, "r1"))
        await asyncio.sleep(0)
        pending.cancel()  # what Ray does when the router dies or cancels the stream
        await asyncio.gather(pending, return_exceptions=True)
        await feed.aclose()
        await asyncio.sleep(0.01)
        with pytest.raises(ConnectionError, match="open a new one"):
            hub.start("router-a", "r2", tokens(never, 1, closed, "r2"))
        return hub, closed

    hub, closed = asyncio.run(scenario())
    assert closed == ["r1"] and not hub._legs and not hub._feeds


def test_the_hub_counts_each_feeds_requests_until_they_end():
    """What a decode engine's load report carries, so a router tells its requests from the
    others' (cluster.pools.Member.estimated_requests)."""

    async def scenario():
        hub, step, never, closed = FeedHub(), asyncio.Event(), asyncio.Event(), []
        hub.start("router-a", "a1", tokens(step, 1, closed, "a1"))
        hub.start("router-a", "a2", tokens(never, 5, closed, "a2"))
        hub.start("router-b", "b1", tokens(never, 5, closed, "b1"))
        started = hub.requests_by_feed()
        step.set()
        for _ in range(100):
            if "a1" in closed:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        one_ended = hub.requests_by_feed()
        hub.abort("a2")
        hub.abort("b1")
        await asyncio.sleep(0.01)
        return started, one_ended, hub.requests_by_feed()

    started, one_ended, none_left = asyncio.run(scenario())
    assert dict(started) == {"router-a": 2, "router-b": 1}
    assert dict(one_ended) == {"router-a": 1, "router-b": 1}
    assert none_left == ()


def test_a_request_failure_reaches_its_router_as_an_event():
    async def failing():
        raise RuntimeError("could not load the state")
        yield  # an async generator

    async def scenario():
        hub = FeedHub()
        feed = hub.stream("router-a")
        first = asyncio.ensure_future(anext(feed))
        await asyncio.sleep(0)
        hub.start("router-a", "r1", failing())
        batch = await first
        await feed.aclose()
        return batch

    (event,) = asyncio.run(scenario())
    assert event.leg_id == "r1" and isinstance(event.error, RuntimeError) and event.output is None


def test_a_request_for_a_feed_nobody_reads_leaves_nothing_behind():
    async def scenario():
        hub, step, closed = FeedHub(), asyncio.Event(), []
        hub.start("router-gone", "r1", tokens(step, 2, closed, "r1"))
        step.set()
        await asyncio.sleep(0.01)
        return hub, closed

    hub, closed = asyncio.run(scenario())
    assert closed == ["r1"] and not hub._feeds and not hub._legs


def test_a_feed_left_unrenewed_ends_and_aborts_its_requests():
    """Ray does not cancel a dead router's stream: the lease on the feed ends it."""

    async def scenario():
        hub, never, closed = FeedHub(timeout_s=0.2), asyncio.Event(), []
        kept, lost = hub.stream("router-alive"), hub.stream("router-dead")
        kept_next, lost_next = asyncio.ensure_future(anext(kept)), asyncio.ensure_future(anext(lost))
        await asyncio.sleep(0)
        hub.start("router-alive", "r-alive", tokens(never, 5, closed, "r-alive"))
        hub.start("router-dead", "r-dead", tokens(never, 5, closed, "r-dead"))
        for _ in range(8):  # only one subscriber renews
            await asyncio.sleep(0.05)
            hub.renew("router-alive")
        ended = await asyncio.gather(lost_next, return_exceptions=True)
        await asyncio.sleep(0.01)
        aborted, alive = list(closed), not kept_next.done()
        with pytest.raises(ConnectionError, match="has ended"):
            hub.start("router-dead", "r-late", tokens(never, 1, closed, "r-late"))
        kept_next.cancel()
        await asyncio.gather(kept_next, return_exceptions=True)
        await kept.aclose()
        return ended, aborted, alive

    ended, aborted, alive = asyncio.run(scenario())
    assert isinstance(ended[0], StopAsyncIteration)  # the unrenewed feed ended
    assert aborted == ["r-dead"]  # with its request; the renewed one goes on
    assert alive


def test_a_request_takes_every_event_that_arrived_and_joins_theirtokens():
    from router.feeds import LegInbox

    async def scenario():
        inbox = LegInbox(asyncio.get_running_loop())
        waiting = asyncio.ensure_future(inbox.take())
        await asyncio.sleep(0)
        assert not waiting.done()
        inbox.put(LegEvent("a", TokenChunk((1,), "x", None, ((1, -0.5),), produced_at=1.0)))
        inbox.put(LegEvent("a", TokenChunk((2, 3), "yz", "length", ((2, -0.1), (3, -0.2)), produced_at=2.0)))
        return await waiting

    events = asyncio.run(scenario())
    assert len(events) == 2
    joined = TokenChunk.joined([e.output for e in events])
    assert joined == TokenChunk((1, 2, 3), "xyz", "length", ((1, -0.5), (2, -0.1), (3, -0.2)), produced_at=1.0)


def test_a_request_on_a_silent_feed_stalls_naming_the_actor():
    """The actor's feed says nothing (no heartbeat): its requests stall, started or not."""
    from messages.errors import DecodeFailedError
    from router.feeds import WorkerFeed

    async def scenario():
        feed = WorkerFeed("decode-7", SilentActor(), stall_timeout_s=0.05, first_event_timeout_s=60)
        quiet, busy = feed.open_leg("quiet-leg"), feed.open_leg("busy-leg")
        await asyncio.sleep(0.1)
        busy.put(LegEvent("busy-leg", TokenChunk((1,), "x")))
        feed.fail_stalled()
        return await quiet.take(), await busy.take()

    (stalled,), (event,) = asyncio.run(scenario())
    assert isinstance(stalled, DecodeFailedError) and "sent nothing" in str(stalled)
    assert "decode-7" in str(stalled) and "quiet-leg" in str(stalled)
    assert event.output.token_ids == (1,)


def test_a_live_feed_lets_a_request_wait_for_its_first_token_but_not_betweentokens():
    """Heartbeats keep the feed speaking: a request that has no token yet (a long prefill on
    the decode engine, a queue) waits up to the first-event timeout; one whose tokens stopped
    stalls after the stall timeout; a negative control past the first-event timeout stalls."""
    from messages.errors import DecodeFailedError
    from router.feeds import WorkerFeed

    async def scenario():
        actor = FeedActor(heartbeat_s=0.05)
        feed = WorkerFeed("decode-5", actor, stall_timeout_s=0.3, first_event_timeout_s=2.5)
        await feed.opened()
        waiting, stopped = feed.open_leg("prefilling"), feed.open_leg("stopped")
        stopped.put(LegEvent("stopped", TokenChunk((1,), "x")))
        await stopped.take()
        await asyncio.sleep(1.5)  # beyond the stall timeout: only heartbeats came
        feed.fail_stalled()
        early = (waiting._events[:], await asyncio.wait_for(stopped.take(), 1))
        await asyncio.sleep(1.2)  # now past the first-event timeout too
        feed.fail_stalled()
        late = await asyncio.wait_for(waiting.take(), 1)
        feed.close()
        return early, late

    (waiting_events, (stopped_error, *_)), (waiting_error, *_) = asyncio.run(scenario())
    assert waiting_events == []
    assert isinstance(stopped_error, DecodeFailedError) and "no token" in str(stopped_error)
    assert isinstance(waiting_error, DecodeFailedError) and "prefilling" in str(waiting_error)


def test_per_step_messages_survive_pickling():
    import pickle

    event = LegEvent("leg", TokenChunk((5, 6), "ab", "stop", ((5, -1.0),), produced_at=3.5))
    assert pickle.loads(pickle.dumps([event, LegEvent("leg", error=ValueError("bad"))]))[0] == event


def test_requests_start_and_abort_over_the_feed_connection_and_refusals_come_back_in_the_feed():
    from messages.errors import InvalidRequestError
    from messages.requests import GenerateRequest
    from router.feeds import WorkerFeed

    async def scenario():
        actor = FeedActor()
        feed = WorkerFeed("decode-1", actor, stall_timeout_s=60, first_event_timeout_s=60)
        await feed.opened()
        inboxes = {name: feed.open_leg(name) for name in ("short", "long", "bad")}
        feed.start_leg(GenerateRequest("short", (5, 6)), None)
        feed.start_leg(GenerateRequest("long", tuple(range(1, 50))), None)
        feed.start_leg(GenerateRequest("bad", (3, 0)), None)
        actor.step.set()
        short = []
        while not short or short[-1].output.finish_reason is None:
            short += await asyncio.wait_for(inboxes["short"].take(), 5)
        (refusal,) = await asyncio.wait_for(inboxes["bad"].take(), 5)
        feed.abort_leg("long")
        for _ in range(100):
            if "long" in actor.closed:
                break
            await asyncio.sleep(0.01)
        feed.close()
        return [e.output.token_ids for e in short], refusal, actor.closed

    short, refusal, closed = asyncio.run(scenario())
    assert short == [(0,), (1,)]
    assert refusal.leg_id == "bad" and isinstance(refusal.error, InvalidRequestError)
    assert "hold a 0" in str(refusal.error)
    assert sorted(closed) == ["long", "short"]  # aborted mid-stream, finished


def test_tokens_cross_the_feed_connection_and_closing_it_aborts_the_requests():
    from router.feeds import WorkerFeed

    async def scenario():
        actor, step, closed = FeedActor(), asyncio.Event(), []
        feed = WorkerFeed("decode-0", actor, stall_timeout_s=60, first_event_timeout_s=60)
        await feed.opened()  # as the orchestrator does before starting requests
        inboxes = {name: feed.open_leg(name) for name in ("r1", "r2")}
        actor.hub.start(feed.subscriber, "r1", tokens(step, 2, closed, "r1"))
        actor.hub.start(feed.subscriber, "r2", tokens(step, 10, closed, "r2"))
        step.set()
        received = []
        while len(received) < 2 or received[-1].output.finish_reason is None:
            received += await inboxes["r1"].take()
        feed.close()  # r2 is still running: the actor must abort it
        for _ in range(100):
            if "r2" in closed:
                break
            await asyncio.sleep(0.01)
        return [e.output.token_ids for e in received], closed

    r1_tokens, closed = asyncio.run(scenario())
    assert r1_tokens == [(0,), (1,)]
    assert sorted(closed) == ["r1", "r2"]


def test_an_orchestrator_closes_the_feeds_of_its_loop_and_the_actor_aborts_their_requests():
    """What a front does when it stops (controller.local_stack): the feeds opened on its loop
    end, connection and all, and nothing of them is left pending on a loop that stops."""
    from cluster.pools import Member, Pool
    from messages.requests import GenerateRequest, ModelLimits
    from router.orchestrator import Orchestrator, RouterPolicy

    async def scenario():
        actor = FeedActor()
        member = Member("decode-0", actor)
        orchestrator = Orchestrator(Pool("prefill"), Pool("decode", [member]), ModelLimits(64, 100), RouterPolicy())
        feed = orchestrator._feed(member)
        await feed.opened()
        feed.open_leg("r1")
        feed.start_leg(GenerateRequest("r1", (5, 6, 7)), None)
        for _ in range(100):
            if actor.hub.requests_by_feed():
                break
            await asyncio.sleep(0.01)
        carried = actor.hub.requests_by_feed()
        await orchestrator.close_feeds()
        for _ in range(100):
            if "r1" in actor.closed:
                break
            await asyncio.sleep(0.01)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and "WorkerFeed" in repr(t)]
        return feed.subscriber, carried, actor.closed, pending, orchestrator._feed(member) is not feed

    subscriber, carried, closed, pending, reopened = asyncio.run(scenario())
    assert carried == ((subscriber, 1),)
    assert closed == ["r1"] and pending == [] and reopened


def test_a_feed_connection_that_breaks_fails_every_request_on_it():
    from messages.errors import FeedLostError
    from router.feeds import WorkerFeed

    async def scenario():
        actor = FeedActor()
        feed = WorkerFeed("decode-3", actor, stall_timeout_s=60, first_event_timeout_s=60)
        await feed.opened()
        inbox = feed.open_leg("r1")
        actor.hub.start(feed.subscriber, "r1", tokens(asyncio.Event(), 5, [], "r1"))
        actor.server._server.close()  # the actor dies: its sockets close
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__ == "FeedServer._serve":
                task.cancel()
        return await asyncio.wait_for(inbox.take(), 5), feed.usable

    (event,), usable = asyncio.run(scenario())
    assert isinstance(event, FeedLostError) and "decode-3" in str(event)
    assert not usable


def test_prefills_sent_before_the_feed_opens_come_back_with_their_results_or_refusals():
    """A prefill leg starts on the feed (no Ray call): started before the connection is up,
    it goes out as it opens; its result, or the actor's refusal, settles its future."""
    from messages.errors import InvalidRequestError
    from messages.requests import GenerateRequest
    from router.feeds import WorkerFeed

    async def scenario():
        actor = FeedActor()
        actor.prefill_gate.set()
        feed = WorkerFeed("prefill-0", actor, stall_timeout_s=60, first_event_timeout_s=60)
        good = feed.prefill(GenerateRequest("p-good", (5, 6, 7)))
        bad = feed.prefill(GenerateRequest("p-bad", (5, 0)))
        result = await asyncio.wait_for(good, 5)
        refusal = await asyncio.wait_for(asyncio.gather(bad, return_exceptions=True), 5)
        feed.close()
        return result, refusal[0], feed._prefills

    result, refusal, left = asyncio.run(scenario())
    assert result.handle.request_id == "p-good" and result.first.token_ids == (9,) and result.cached_tokens == 3
    assert isinstance(refusal, InvalidRequestError) and "hold a 0" in str(refusal)
    assert left == {}


def test_an_aborted_prefill_says_so_and_a_broken_feed_fails_the_prefills_on_it():
    """A timed-out prefill is aborted on the actor, whose last word settles it (a result
    that came first would name blocks to free); the others on a feed that breaks fail."""
    from messages.errors import FeedLostError, LegAbortedError
    from messages.requests import GenerateRequest
    from router.feeds import WorkerFeed

    async def scenario():
        actor = FeedActor()  # its prefills wait for a gate that never opens
        feed = WorkerFeed("prefill-1", actor, stall_timeout_s=60, first_event_timeout_s=60)
        aborted, cut_off = (feed.prefill(GenerateRequest(name, (5, 6))) for name in ("p-aborted", "p-cut-off"))
        await feed.opened()
        while actor.prefills < 2:
            await asyncio.sleep(0.01)
        feed.abort_leg("p-aborted")
        abort = await asyncio.wait_for(asyncio.gather(aborted, return_exceptions=True), 5)
        actor.server._server.close()  # the actor dies: its sockets close
        for task in asyncio.all_tasks():
            if task.get_coro().__qualname__ == "FeedServer._serve":
                task.cancel()
        lost = await asyncio.wait_for(asyncio.gather(cut_off, return_exceptions=True), 5)
        return abort[0], lost[0], actor.closed

    abort, lost, closed = asyncio.run(scenario())
    assert isinstance(abort, LegAbortedError) and "p-aborted" in str(abort)
    assert isinstance(lost, FeedLostError) and "prefill-1" in str(lost)
    assert sorted(closed) == ["p-aborted", "p-cut-off"]  # the actor stopped both engine legs


def test_a_prefill_on_a_silent_feed_stalls():
    from messages.errors import LegStalledError
    from messages.requests import GenerateRequest
    from router.feeds import WorkerFeed

    async def scenario():
        feed = WorkerFeed("prefill-2", SilentActor(), stall_timeout_s=0.05, first_event_timeout_s=60)
        pending = feed.prefill(GenerateRequest("p-1", (5, 6)))
        await asyncio.sleep(0.1)
        feed.fail_stalled()
        stalled = await asyncio.gather(pending, return_exceptions=True)
        feed.close()
        return stalled[0]

    stalled = asyncio.run(scenario())
    assert isinstance(stalled, LegStalledError) and "prefill-2 sent nothing" in str(stalled)


def test_a_stalled_prefills_late_result_is_handed_over_to_free_its_blocks():
    """The feed went silent (a partition): the prefill leg failed as stalled; when the feed
    speaks again, its result, nobody's now, goes to the router to free the blocks it names."""
    from messages.errors import LegStalledError
    from messages.requests import GenerateRequest
    from router.feeds import WorkerFeed

    async def scenario():
        actor, orphans = FeedActor(), []
        feed = WorkerFeed("prefill-3", actor, 0.05, 60, on_orphaned_prefill=orphans.append)
        pending = feed.prefill(GenerateRequest("p-late", (5, 6)))
        await feed.opened()
        await asyncio.sleep(0.1)  # no heartbeat within the stall timeout
        feed.fail_stalled()
        stalled = await asyncio.gather(pending, return_exceptions=True)
        actor.prefill_gate.set()
        while not orphans:
            await asyncio.sleep(0.01)
        feed.close()
        return stalled[0], orphans

    stalled, orphans = asyncio.run(scenario())
    assert isinstance(stalled, LegStalledError)
    assert [o.handle.request_id for o in orphans] == ["p-late"]


def test_the_feed_port_drops_silent_peers_and_second_readers():
    from vllm_engine.feed import FeedServer

    async def scenario():
        hub = FeedHub()
        server = FeedServer(hub, "127.0.0.1", {}, hello_timeout_s=0.2)
        address = await server.address()

        async def connect(hello: bytes | None):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            if hello is not None:
                writer.write(hello)
            return reader, writer

        valid = f"router-a {address.token}\n".encode()
        silent, overlong, no_token = await connect(None), await connect(b"x" * 100_000), await connect(b"router-a\n")
        wrong_token = await connect(b"router-a " + b"0" * len(address.token) + b"\n")
        first = await connect(valid)
        opened = await asyncio.wait_for(first[0].readexactly(4), 5)
        second = await connect(valid)
        ends = [await asyncio.wait_for(r.read(), 5) for r, _ in (silent, overlong, no_token, wrong_token, second)]
        return opened, ends, hub.is_streaming("router-a")  # `first` still holds its connection

    opened, ends, still_streaming = asyncio.run(scenario())
    assert opened == bytes(4)  # the feed-open frame
    assert ends == [b""] * 5  # each closed without a frame
    assert still_streaming  # the first reader keeps its feed


class _RunsCommand:
    """A pickle that would run a shell command when loaded by a plain unpickler."""

    def __reduce__(self):
        import os

        return os.system, ("touch /tmp/pdserve-feed-pwned",)


def test_a_frame_that_is_not_a_feed_command_ends_the_connection_without_running_anything():
    import os
    import pickle

    from vllm_engine.feed import FeedServer

    async def scenario():
        hub, started = FeedHub(), []
        server = FeedServer(hub, "127.0.0.1", {StartLeg: lambda *args: started.append(args)})
        address = await server.address()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"router-a {address.token}\n".encode())
        opened = await asyncio.wait_for(reader.readexactly(4), 5)
        payload = pickle.dumps(_RunsCommand())
        writer.write(len(payload).to_bytes(4, "big") + payload)
        end = await asyncio.wait_for(reader.read(), 5)
        streaming = hub.is_streaming("router-a")
        # Garbage with the token ends a connection the same way.
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(f"router-b {address.token}\n".encode() + (5).to_bytes(4, "big") + b"junk!")
        garbage = await asyncio.wait_for(reader.read(), 5)
        return opened, end, started, streaming, garbage, hub.is_streaming("router-b")

    if os.path.exists("/tmp/pdserve-feed-pwned"):
        os.remove("/tmp/pdserve-feed-pwned")
    opened, end, started, streaming, garbage, garbage_streaming = asyncio.run(scenario())
    assert opened == bytes(4) and end == b""  # the feed ended on the bad frame
    assert not os.path.exists("/tmp/pdserve-feed-pwned") and not started and not streaming
    assert garbage == bytes(4) and not garbage_streaming  # opened, then ended on the junk
