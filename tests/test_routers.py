"""Several routers in front of one controller, with real engines, Ray, NIXL and gRPC:
streams through both are correct, killing one router (kill -9) mid-stream leaves the
other's streams intact and no blocks held, the controller and engines outlive it, a new
router joins, and routers that pick independently still balance the decode pool. Last, the
controller's closed-loop planner moves the split with the traffic (it holds until then:
no earlier test finishes its minimum of requests in one interval). The engines run both NIXL
roles (`switch_roles`), so the planner's change moves an engine between the pools without a
restart (tests/test_resize.py covers the restarting kind). Then the controller is killed,
and Ray's restart of it adopts the engines where they are."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import grpc
import pytest
from conftest import run, stream_tokens, wait_until
from reference import PROMPTS

from messages.membership import Lifecycle
from messages.results import FEED_TIMEOUT_S
from router.client import build_request

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)

LEASE_S = 6
LONG = 2000  # tokens: a stream that outlives the test unless it is aborted


@pytest.fixture(scope="module")
def controller(ray_cluster, engine_config):
    """1P:2D of either-role engines; its planner decides every 4 s on the seeds' model,
    acting on 8+ requests."""
    from controller.actor import controller_for
    from controller.deployment import DeploymentConfig
    from controller.planning import PlannerSetup
    from kv_transfer.connector_config import TransferConfig
    from messages.timings import SLO
    from planner.closed_loop import PlannerConfig
    from planner.model import PerformanceModel

    config = DeploymentConfig(
        engine=engine_config,
        transfer=TransferConfig(lease_s=LEASE_S),
        num_decode=2,
        drain_quiet_s=1.0,
        switch_roles=True,
    )
    planner = PlannerConfig(
        instances=3, slo=SLO(ttft_s=2.0, itl_s=0.1), interval_s=4.0, cooldown_s=0, min_requests=8, search_requests=100
    )
    setup = PlannerSetup(planner, PerformanceModel.seeds_example())
    handle, created = controller_for(config, f"test-controller-{uuid.uuid4().hex[:6]}", planner=setup)
    assert created
    ray_cluster.get(handle.start.remote())
    yield handle
    ray_cluster.get(handle.shutdown.remote())
    ray_cluster.kill(handle, no_restart=True)


def _settings(model_path: str):  # noqa: ANN202
    """A router on a free port, without a metrics endpoint."""
    from router.actor import RouterSettings

    return RouterSettings(model=model_path, listen="127.0.0.1:0", metrics_port=0, health_interval_s=0.2, tier_size=2)


def _routers(controller, model_path, *names):
    """Routers started at once (each loads its tokenizer and imports in its own process)."""
    import ray

    from router.actor import RouterActor

    actors = [RouterActor.remote(name, controller, _settings(model_path)) for name in names]
    return [(actor, addresses.grpc) for actor, addresses in zip(actors, ray.get([a.serve.remote() for a in actors]))]


@pytest.fixture
def routers(ray_cluster, controller, model_path):
    names = ("router-a", "router-b")
    made = _routers(controller, model_path, *names)
    yield made
    for (actor, _), name in zip(made, names):
        ray_cluster.kill(actor, no_restart=True)
        ray_cluster.get(controller.router_left.remote(name))  # its admission share is free at once


def test_a_grpc_router_tokenizes_as_transformers_does(model_path):
    """A router without the HTTP front encodes with the Rust tokenizer alone: the same ids."""
    from transformers import AutoTokenizer

    from router.prompt_encoder import prompt_encoder
    from vllm_engine.embedded_model.texts import documents

    hf, encode = AutoTokenizer.from_pretrained(model_path), prompt_encoder(model_path)
    texts = ["", "  two leading spaces", "\u00fcn\u00efc\u00f8d\u00e9 \u6f22\u5b57 \U0001f642"]
    texts += ["<|im_start|>user\nhi<|im_end|>"] + [document[:2000] for document in documents()]
    for text in texts:
        assert encode(text) == hf.encode(text), text[:80]


def _engines_idle(ray, controller) -> bool:
    view = ray.get(controller.view.remote())
    loads = ray.get([m.actor.load.remote() for m in view.prefill + view.decode])
    return all(
        not (load.running or load.waiting or load.held_for_transfer) and load.free_blocks == load.total_blocks
        for load in loads
    )


async def _open_stream(address: str, prompt: str, request_id: str, max_tokens: int):
    """Start a stream; returns once decode streams it (two tokens in: prefill may send the
    first before decode has the request), with a task that finishes it."""
    channel = grpc.aio.insecure_channel(address)
    request = build_request(list(PROMPTS[prompt]), request_id, max_tokens=max_tokens, ignore_eos=True)
    from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc

    call = pb_grpc.GenerationStub(channel).Generate(request)
    responses = call.__aiter__()
    tokens = []
    while len(tokens) < 2:
        tokens.extend((await anext(responses)).chunk.token_ids)

    async def rest():
        try:
            async for response in responses:
                if response.HasField("chunk"):
                    tokens.extend(response.chunk.token_ids)
                else:
                    return tokens, response.final
            return tokens, None
        finally:
            await channel.close()

    return call, asyncio.ensure_future(rest())


def test_streams_through_both_routers_equal_the_reference(routers, reference):
    names = ["short", "over_one_block", "x", "y"]

    async def both():
        async def one(address, name, i):
            async with grpc.aio.insecure_channel(address) as channel:
                request = build_request(
                    list(PROMPTS[name]), f"two-{i}", max_tokens=len(reference[name].tokens), ignore_eos=True
                )
                return await stream_tokens(channel, request)

        return await asyncio.gather(*(one(routers[i % 2][1], name, i) for i, name in enumerate(names)))

    for name, (tokens, _, final) in zip(names, run(both())):
        decisive = reference[name].decisive
        assert tokens[: len(decisive)] == decisive and final.finish_reason == "length"


def test_killing_a_router_mid_stream_leaves_the_other_and_frees_its_blocks(
    ray_cluster, controller, routers, reference, model_path
):
    (victim, victim_address), (survivor, survivor_address) = routers
    before = ray_cluster.get(controller.view.remote())
    survivor_tokens = 150

    async def scenario():
        doomed = [await _open_stream(victim_address, "over_one_block", f"doomed-{i}", LONG) for i in range(2)]
        kept = [await _open_stream(survivor_address, name, f"kept-{name}", survivor_tokens) for name in ("x", "y")]
        os.kill(await victim.pid.remote(), signal.SIGKILL)
        for _, finishing in doomed:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await finishing
            assert lost.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        return [await finishing for _, finishing in kept]

    for name, (tokens, final) in zip(("x", "y"), run(scenario())):
        decisive = reference[name].decisive
        assert final is not None and final.finish_reason == "length" and len(tokens) == survivor_tokens
        assert tokens[: len(decisive)] == decisive
    # The dead router's two streams (2,000 tokens each) were aborted on the decode engine when
    # their feed's connection closed (its lease is the backstop), not left to run; any
    # prefill blocks went back within theirs.
    settle_s = max(LEASE_S, FEED_TIMEOUT_S) + 5
    assert wait_until(lambda: _engines_idle(ray_cluster, controller), timeout_s=settle_s), "blocks still held"

    after = ray_cluster.get(controller.view.remote())  # the controller outlived the router
    assert [(m.name, m.load.engine_id) for m in after.prefill + after.decode] == [
        (m.name, m.load.engine_id) for m in before.prefill + before.decode
    ]  # same engines, none restarted: no router owns them
    assert all(m.lifecycle is Lifecycle.LIVE for m in after.prefill + after.decode)

    ((newcomer, address),) = _routers(controller, model_path, "router-c")  # a new router joins
    try:

        async def through_newcomer():
            async with grpc.aio.insecure_channel(address) as channel:
                request = build_request(list(PROMPTS["short"]), "joined", max_tokens=8, ignore_eos=True)
                return await stream_tokens(channel, request)

        tokens, _, final = run(through_newcomer())
        assert tokens == reference["short"].tokens[:8] or len(tokens) == 8
        assert final.finish_reason == "length"
    finally:
        ray_cluster.kill(newcomer, no_restart=True)


def test_two_routers_balance_the_decode_pool(ray_cluster, controller, routers):
    """Router A starts 3 streams, then router B starts 3: B sees A's streams in the engines'
    load reports (through the controller's view) and evens the pool out. Picking on its own
    in-flight counts alone, B would send 2 of its 3 to one engine half of the time
    (tests/test_pools.py measures that imbalance without engines)."""
    (a, a_address), (b, b_address) = routers

    async def scenario():
        streams = [await _open_stream(a_address, "short", f"bal-a-{i}", LONG) for i in range(3)]
        # Until the controller's view carries A's streams (a busy engine answers its load
        # poll late), then B's mirror refreshes (every 0.2 s; under a loaded suite a refresh
        # can take several times that: one full run saw B pick on a view without them).
        for _ in range(100):
            view = await controller.view.remote()
            if sum(m.load.running + m.load.waiting for m in view.decode if m.load) >= 3:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.5)
        streams += [await _open_stream(b_address, "short", f"bal-b-{i}", LONG) for i in range(3)]
        view = await controller.view.remote()
        loads = [await m.actor.load.remote() for m in view.decode]
        for call, finishing in streams:
            call.cancel()
            finishing.cancel()
        return [load.running + load.waiting for load in loads]

    counts = run(scenario())
    assert sum(counts) == 6 and max(counts) - min(counts) <= 1, counts
    assert wait_until(lambda: _engines_idle(ray_cluster, controller), timeout_s=LEASE_S + 4), (
        "cancelled streams left blocks"
    )


def test_pdserve_verify_checks_every_pair_of_the_controllers_pools(ray_cluster, controller):
    """`pdserve verify`'s battery on the controller's live pools: every prefill/decode pair
    hands off a short and a long prompt, cold and on a prefix hit, and each agrees with the
    decode engine's colocated recompute."""
    from cli.verify import VerifyConfig, battery

    view = ray_cluster.get(controller.view.remote())
    checks = run(battery(view, VerifyConfig(prompt_lengths=(16, 700), steps=8)))
    pairs = {(p.name, d.name) for p in view.prefill for d in view.decode}
    assert {(c.verdict.prefill, c.verdict.decode) for c in checks} == pairs
    assert len(checks) == len(pairs) * 2 * 2
    assert all(c.verdict.agrees and c.verdict.steps == 8 for c in checks), [c.row() for c in checks]
    long_hits = [c.cached_tokens for c in checks if c.prompt_tokens == 700]
    assert not any(long_hits[0::2]) and all(long_hits[1::2]), f"the second run hits the prefix cache: {long_hits}"


def test_a_router_passes_a_resize_to_the_controller_and_its_refusal_back(routers):
    """Admin.ScalePools on any router reaches the controller; a refusal comes back as the
    controller's own words, not a Ray traceback."""
    from proto.pdserve.v1 import generate_pb2 as pb
    from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc

    async def scale():
        async with grpc.aio.insecure_channel(routers[0][1]) as channel:
            await pb_grpc.AdminStub(channel).ScalePools(pb.ScalePoolsRequest(prefill=0, decode=2))

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        run(scale())
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details().startswith("resize keeps the serving mode")


def test_the_planner_moves_an_engine_to_prefill_without_a_restart_or_a_failed_request(
    ray_cluster, controller, routers, reference
):
    """Prefill-heavy traffic (1,500-token prompts, 4 tokens out, 4 req/s: more than one CPU
    prefill engine serves): within a few 4-s intervals the controller's planner changes 1P:2D
    to 2P:1D while traffic flows, by draining a decode engine and handshaking it as a
    producer: the same three engine processes serve before and after, and both prefill
    engines hand off state that decodes to the reference."""
    from reference import assert_matches, make_request

    from router.client import build_request, stream_generate

    before = ray_cluster.get(controller.view.remote())
    engines_before = {m.name: m.load.engine_id for m in before.prefill + before.decode}

    address = routers[0][1]
    prompt = [(7 * i) % 2000 + 1 for i in range(1500)]

    async def traffic(stop: asyncio.Event) -> tuple[int, list[str]]:
        # Past the tier's admission limits (on a box without AVX512 prefill serves well under
        # this rate) arrivals are turned away with RESOURCE_EXHAUSTED: retriable, not a failure.
        done, failures = 0, []
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(i: int) -> None:
                nonlocal done
                request = build_request(prompt, f"plan-{i}", max_tokens=4, ignore_eos=True)
                try:
                    async for _ in stream_generate(channel, request, timeout_s=120):
                        pass
                    done += 1
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        failures.append(f"{err.code().name}: {err.details()}")

            tasks, i = [], 0
            while not stop.is_set():
                tasks.append(asyncio.ensure_future(one(i)))
                i += 1
                await asyncio.sleep(0.25)
            await asyncio.gather(*tasks)
        return done, failures

    async def scenario() -> tuple[bool, int, list[str]]:
        stop = asyncio.Event()
        running = asyncio.ensure_future(traffic(stop))
        changed = False
        for _ in range(150):
            await asyncio.sleep(1)
            view = await controller.view.remote()
            live = all(m.lifecycle is Lifecycle.LIVE for m in view.prefill)
            if len(view.prefill) == 2 and len(view.decode) == 1 and live:
                changed = True
                break
        await asyncio.sleep(3)  # traffic on the new split
        stop.set()
        return (changed, *await running)

    changed, done, failures = run(scenario())
    log = ray_cluster.get(controller.planner_log.remote())
    print("\n".join(log))
    assert changed, "\n".join(log)
    assert failures == [] and done > 0
    assert any("change 1P:2D -> 2P:1D" in line for line in log)
    assert any(line.startswith("planner split change 1P:2D -> 2P:1D took") for line in log)
    after = ray_cluster.get(controller.view.remote())
    assert {m.name: m.load.engine_id for m in after.prefill + after.decode} == engines_before  # none restarted
    moved = {m.name for m in after.prefill} - {m.name for m in before.prefill}
    assert len(moved) == 1

    async def through_each_prefill_engine():
        async with grpc.aio.insecure_channel(address) as channel:
            ref = make_request("over_one_block")
            prompt, max_tokens = list(ref.prompt_token_ids), ref.sampling.max_tokens
            requests = [build_request(prompt, f"moved-{i}", max_tokens=max_tokens, ignore_eos=True) for i in range(2)]
            for i, request in enumerate(requests):
                # Cached nowhere: the second goes where the first's prompt is not queued. (An
                # engine holding it cached would take both: little to compute for either.)
                request.cache_salt = f"moved-{i}"
            return await asyncio.gather(*(stream_tokens(channel, request) for request in requests))

    results = run(through_each_prefill_engine())
    for tokens, _, _ in results:
        assert_matches(tokens, reference["over_one_block"])
    assert {final.prefill_worker for _, _, final in results} == {m.name for m in after.prefill}


def test_a_killed_controller_comes_back_with_its_engines_in_their_pools(ray_cluster, controller, routers, reference):
    """Ray restarts a killed controller, and the new one adopts the running engines from its
    checkpoint: the same engine processes, each in the pool it served (after the planner's
    move, which names alone do not say), none restarted. A stream started before the kill
    finishes meanwhile: the routers route on the last view."""
    from reference import assert_matches

    def pid(actor) -> int:
        return ray_cluster.get(actor.__ray_call__.remote(lambda _: os.getpid()))

    before = ray_cluster.get(controller.view.remote())
    engines = {
        pool: {m.name: pid(m.actor) for m in members}
        for pool, members in (("prefill", before.prefill), ("decode", before.decode))
    }
    old_controller = pid(controller)
    name = "over_one_block"

    async def stream_across_the_kill():
        async with grpc.aio.insecure_channel(routers[0][1]) as channel:
            request = build_request(
                list(PROMPTS[name]), "across-kill", max_tokens=len(reference[name].tokens), ignore_eos=True
            )
            streaming = asyncio.ensure_future(stream_tokens(channel, request))
            await asyncio.sleep(0.3)
            ray_cluster.kill(controller, no_restart=False)
            return await streaming

    tokens, _, _ = run(stream_across_the_kill())
    assert_matches(tokens, reference[name])

    def back() -> bool:
        try:
            return pid(controller) != old_controller and ray_cluster.get(controller.view.remote()) is not None
        except Exception:  # restarting, or adopting its engines
            return False

    started = time.monotonic()
    assert wait_until(back, 60, 0.2), "the controller did not come back"
    print(f"controller back and serving its view {time.monotonic() - started:.1f} s after the kill")
    after = ray_cluster.get(controller.view.remote())
    assert {
        pool: {m.name: pid(m.actor) for m in members}
        for pool, members in (("prefill", after.prefill), ("decode", after.decode))
    } == engines
    assert all(m.lifecycle is Lifecycle.LIVE for m in after.prefill + after.decode)
    assert wait_until(lambda: _engines_idle(ray_cluster, controller), 5), "blocks still held"


def test_four_routers_hold_the_tiers_admission_limits_under_a_burst(ray_cluster, controller, model_path):
    """Admission is the tier's: 4 routers on one port (connections spread by SO_REUSEPORT)
    with --max-in-flight 8 --max-queue 4 take at most 12 requests of a 60-request burst
    (each router applying the limits alone would take up to 48), and every one they take
    completes. Each request holds its slot for far longer than the burst takes to arrive."""
    import dataclasses

    from router.server import FrontDoorConfig
    from router.tier import RouterTier

    limit = 8 + 4
    settings = dataclasses.replace(_settings(model_path), front=FrontDoorConfig(max_in_flight=8, max_queue=4))

    async def one(address: str, i: int) -> str:
        # A connection of its own (gRPC otherwise shares one among channels to one address).
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            request = build_request(list(PROMPTS["short"]), f"burst-{i}", max_tokens=160, ignore_eos=True)
            try:
                tokens, _, final = await stream_tokens(channel, request, timeout_s=120)
            except grpc.aio.AioRpcError as err:
                return err.code().name
            return "OK" if len(tokens) == 160 and final.finish_reason == "length" else "SHORT"

    async def scenario() -> list[str]:
        tier = RouterTier(controller, settings)
        try:
            addresses = await tier.start(4)
            # SO_REUSEPORT: one address, four router processes behind it.
            assert len({a.grpc for a in addresses}) == 1, addresses
            assert len({await actor.pid.remote() for actor, _ in tier.routers.values()}) == 4
            address = addresses[0].grpc
            await asyncio.sleep(2)  # a few view intervals: the routers' shares settle
            return await asyncio.gather(*(one(address, i) for i in range(60)))
        finally:
            await tier.drain(30)

    outcomes = run(scenario())
    taken = len(outcomes) - outcomes.count("RESOURCE_EXHAUSTED")
    print(f"taken {taken} of 60 (tier limit {limit}, overshoot {taken / limit - 1:+.0%}):", sorted(set(outcomes)))
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert limit // 2 <= taken <= limit * 1.1, outcomes


def test_the_tier_replaces_a_killed_router_and_the_controller_forgets_it_at_once(ray_cluster, controller, model_path):
    """`pdserve serve --routers 2`'s tier: a router SIGKILLed (it drains nothing and says
    nothing) is replaced in its slot, and the tier tells the controller it left, so its
    admission share and its metrics target go at once, not when its share expires (5 s);
    the replacement serves."""
    from router.tier import RouterTier

    async def known(name: str) -> tuple[bool, bool]:
        """Whether the controller still holds `name`'s admission share, and lists its metrics."""
        return await controller.__ray_call__.remote(lambda c: (name in c._admission._holdings, name in c._targets))

    async def scenario() -> tuple[bool, bool, list[int]]:
        tier = RouterTier(controller, _settings(model_path), check_interval_s=0.3)
        try:
            await tier.start(2)
            victim, _ = tier.routers[0]
            await asyncio.sleep(1)  # a few views: both routers hold a share
            assert (await known("router-0"))[0] and (await known("router-1"))[0]
            os.kill(await victim.pid.remote(), signal.SIGKILL)
            killed = time.monotonic()
            while (await known("router-0"))[0] and time.monotonic() - killed < 3:
                await asyncio.sleep(0.1)
            forgotten = not any(await known("router-0")) and time.monotonic() - killed < 3
            while 0 not in tier.routers or tier.routers[0][0] is victim:
                assert time.monotonic() - killed < 60, "no router took slot 0"
                await asyncio.sleep(0.2)
            async with grpc.aio.insecure_channel(tier.routers[0][1].grpc) as channel:
                request = build_request(list(PROMPTS["short"]), "replacement", max_tokens=8, ignore_eos=True)
                tokens, _, _ = await stream_tokens(channel, request, timeout_s=60)
            return forgotten, (await known("router-2"))[0], tokens
        finally:
            await tier.drain(30)

    forgotten, replacement_holds_a_share, tokens = run(scenario())
    assert forgotten, "the controller still counted the killed router 3 s later"
    assert replacement_holds_a_share and len(tokens) == 8
