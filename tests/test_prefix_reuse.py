"""Prefix caching through P/D on the embedded hybrid (vLLM's align mode): 2P+2D with caching on
in both pools against a colocated engine computing every prompt whole (each reference request
under a cache salt of its own), token for token; what each
engine reused (cached tokens reported, prompt tokens by source, bytes NIXL moved) and where
the router sent each prompt (the engine its copies of their prefix indexes found it on).

Positions are in whole blocks of the engines' own block size (256 tokens, or 128 where the
DeltaNet state is bf16): a prompt a hybrid engine prefills reuses a prefix up to the last block
end where a state checkpoint was kept, which vLLM does where a prompt's last whole block ends,
every CHECKPOINT_BLOCKS blocks of a prompt (--state-checkpoint-tokens) and at the last two block
ends decoded past; a decode leg, which pulls the final state, needs the attention blocks alone."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import math

import httpx
import pytest
import ray
from conftest import assert_no_blocks_held, run
from prometheus_client.parser import text_string_to_metric_families
from reference import (
    MAX_TOKENS,
    MIN_COMPARED,
    NEAR_TIE_NATS,
    Reference,
    assert_matches,
    collect,
    prompt_of,
    reference_run,
)

from kv_transfer.connector_config import TransferConfig
from messages.requests import GenerateRequest, SamplingConfig

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)

TURNS = 4
QUESTION = 60  # tokens a conversation's user adds per turn
SCAN_TOKENS = 2150  # of the lesson, read to find where its continuations are decisive
PREFILL_CACHE_BYTES = 10 << 20  # a little over the blocks of one 8,192-token request
CHECKPOINT_BLOCKS = 4  # past the cases' shared prefixes, so those end where no checkpoint is


@functools.cache
def _lesson() -> tuple[int, ...]:
    """The corpus's second document: the model reproduces it, so most continuations are decisive."""
    from vllm_engine.embedded_model import ensure_embedded_model
    from vllm_engine.embedded_model.texts import EOS_ID, token_stream

    stream = token_stream(ensure_embedded_model())
    start = stream.index(EOS_ID) + 1
    return tuple(stream[start : stream.index(EOS_ID, start)])


@dataclasses.dataclass(frozen=True)
class Case:
    offset: int  # where in the lesson its prompt starts
    length: int

    def request(
        self, request_id: str, logprobs: int | None = None, max_tokens: int = MAX_TOKENS, cache_salt: str = ""
    ) -> GenerateRequest:
        sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        prompt = _lesson()[self.offset : self.offset + self.length]
        return GenerateRequest(request_id, prompt, sampling, cache_salt)


async def _chunks(actor, request) -> list:
    return [await ref async for ref in actor.generate.remote(request)]


def _clear(token: int, position) -> bool:
    """`token` is the engine's first choice at this prompt position, by NEAR_TIE_NATS or more
    (entries: (token id, logprob, rank, text), the prompt's own token first)."""
    own_token, own_logprob, own_rank, _ = position[0]
    runner_up = max((logprob for _, logprob, rank, _ in position if rank == 2), default=-math.inf)
    return own_token == token and own_rank == 1 and own_logprob - runner_up >= NEAR_TIE_NATS


@pytest.fixture(scope="module")
def colocated(colocated_engine):
    """The reference: the session's colocated engine, each request under a cache salt no other
    request carries, so it computes its whole prompt as an engine without a cache does."""
    return colocated_engine


@pytest.fixture(scope="module")
def block(colocated) -> int:
    return ray.get(colocated.state_layout.remote()).block_size


@pytest.fixture(scope="module")
def cases(colocated, block) -> dict[str, Case]:
    """Each group at the first offset where every case's continuation is decisive for
    MIN_COMPARED tokens. The model is trained on each machine and reproduces 99% of its
    corpus, so where the lesson's continuations are clear is read here, teacher-forced in
    one prefill: each lesson token is clear where it is the model's first choice given the
    lesson before it, by at least NEAR_TIE_NATS (what a greedy run along the lesson finds)."""
    lesson = _lesson()[:SCAN_TOKENS]
    scan = GenerateRequest("scan", lesson, SamplingConfig(max_tokens=1, prompt_logprobs=2), cache_salt="uncached-scan")
    chunks = run(_chunks(colocated, scan))
    positions = chunks[0].prompt_logprobs
    assert len(positions) == len(lesson), (len(positions), len(lesson))
    clear = [False] + [_clear(token, p) for token, p in zip(lesson[1:], positions[1:])]

    def decisive(start: int) -> bool:  # start: lesson index of the first continuation token
        return all(clear[start : start + MIN_COMPARED]) and start + MIN_COMPARED <= len(clear)

    def first(offset: int, lengths: range) -> int | None:
        return next((n for n in lengths if decisive(offset + n)), None)

    def document(offset: int) -> dict[str, int] | None:
        """Prefill keeps a state checkpoint at 2 blocks of the document (2 blocks + 40); the
        others share it: the document and more, a prefix ending inside its third block, and
        one token past the second (the hit leaves one token to compute); and past the first
        checkpoint mark (CHECKPOINT_BLOCKS blocks) of a longer prompt there."""
        one_past = 2 * block + 1
        inside = first(offset, range(2 * block + 5, 2 * block + 40))
        longer = first(offset, range(2 * block + 41, 2 * block + 200))
        marked = first(offset, range(CHECKPOINT_BLOCKS * block + 41, (CHECKPOINT_BLOCKS + 1) * block))
        if not decisive(offset + one_past) or None in (inside, longer, marked):
            return None
        return {"document": 2 * block + 40, "one_past": one_past, "inside": inside, "longer": longer, "marked": marked}

    def conversation(offset: int) -> dict[str, int] | None:
        """Each turn's prompt is the last one, its 80-token answer and a 20-120-token question;
        the first is under a block and its answer fills it, so only decode holds that block
        after turn 1."""
        turns = [first(offset, range(block - MAX_TOKENS + 1, block - 20))]
        while turns[-1] is not None and len(turns) < TURNS:
            turns.append(first(offset, range(turns[-1] + MAX_TOKENS + 20, turns[-1] + MAX_TOKENS + 121)))
        if None in turns:
            return None
        return {f"turn{i + 1}": n for i, n in enumerate(turns)}

    chosen: dict[str, Case] = {}
    taken = 0
    for group in (document, conversation):
        found = next(((o, g) for o in range(taken, len(clear)) if (g := group(o)) is not None), None)
        assert found, f"no offset past {taken} of the lesson where every {group.__name__} case is decisive"
        offset, lengths = found
        chosen.update({name: Case(offset, n) for name, n in lengths.items()})
        taken = offset + max(lengths.values()) + MAX_TOKENS  # the next group shares nothing with it
    return chosen


@pytest.fixture(scope="module")
def uncached(colocated, cases) -> dict[str, Reference]:
    return {
        name: run(reference_run(colocated, case.request(f"ref-{name}", logprobs=2, cache_salt=f"uncached-{name}")))
        for name, case in cases.items()
    }


@pytest.fixture(scope="module")
def deployment(ray_cluster, engine_config, uncached, block):
    from controller.deployment import Deployment, DeploymentConfig
    from vllm_engine.config import EngineSizing

    # Prefill caches of PREFILL_CACHE_BYTES: a few prompts evict a document (the last test).
    prefill = EngineSizing(kv_cache_bytes=PREFILL_CACHE_BYTES)
    transfer = TransferConfig(lease_s=30)
    engine = dataclasses.replace(engine_config, state_checkpoint_tokens=CHECKPOINT_BLOCKS * block)
    config = DeploymentConfig(engine=engine, transfer=transfer, num_prefill=2, num_decode=2, prefill_sizing=prefill)
    dep = Deployment(config)
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def _generate(orchestrator, name: str, case: Case, cache_salt: str = ""):
    async def go():
        request = case.request(f"pd-{name}", cache_salt=cache_salt)
        return await asyncio.wait_for(collect(orchestrator.generate(request)), 120)

    return run(go())


def _samples(member, metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One worker's current values of `metric` (its own Prometheus endpoint), by labels."""
    address = ray.get(member.actor.metrics_address.remote())
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == metric
    }


def _prompt_tokens(member) -> dict[str, float]:
    return {dict(k)["source"]: v for k, v in _samples(member, "pdserve_prompt_tokens_total").items()}


def _nixl_bytes(member) -> float:
    return sum(_samples(member, "pdserve_nixl_transfer_bytes_sum").values())


def test_caching_is_on_in_both_pools_and_says_how_it_reuses(deployment, block):
    dep, _ = deployment
    for name, capacity in dep.capacities.items():
        assert capacity.prefix_caching and capacity.block_size == block, name
        assert f"whole {block}-token blocks" in capacity.summary() and "DeltaNet" in capacity.summary()


def _member(dep, name: str):
    return next(m for m in dep.prefill.members + dep.decode.members if m.name == name)


def _predicted() -> float:
    """Prompt tokens the routers' picked prefill engines said they held (this process's router)."""
    from router import metrics

    return metrics.PREDICTED_CACHED_TOKENS._value.get()


def test_a_prefill_hit_equals_colocated_without_cache(deployment, uncached, cases, block):
    """The document, then the document with more, with two prefill engines: the router's
    copies of both engines' indexes send it to the one with the document, which computes only
    past its 2 cached blocks (the shared prefix ends inside the third), as the copy said: the
    router hashed the prompt as that engine's events name its blocks. Decode has no state
    checkpoint there (it decoded past no block end), so it pulls every block."""
    dep, orchestrator = deployment
    _, first = _generate(orchestrator, "document", cases["document"])
    assert first.cached_tokens == 0
    holder = _member(dep, first.prefill_worker)
    assert ray.get(holder.actor.prefix_index_blocks.remote()) > 0
    assert sum(_samples(holder, "pdserve_prefix_index_blocks").values()) > 0
    assert sum(_samples(holder, "pdserve_kv_event_lag_seconds_count").values()) > 0  # batches applied
    before, predicted = _prompt_tokens(holder), _predicted()
    tokens, result = _generate(orchestrator, "longer", cases["longer"])
    assert_matches(tokens, uncached["longer"])
    assert result.prefill_worker == holder.name and result.cached_tokens == 2 * block
    assert _predicted() - predicted == 2 * block  # the router's copy of the engine's index, from vLLM's events
    after = _prompt_tokens(holder)
    assert after["local_cache_hit"] - before.get("local_cache_hit", 0) == 2 * block
    assert after["computed"] - before["computed"] == cases["longer"].length - 2 * block
    assert_no_blocks_held(dep)


def test_a_hybrid_prefix_without_its_checkpoint_goes_where_its_blocks_are(deployment, uncached, cases, block):
    """Two prompts share 2 blocks, and each ends past a third: prefill keeps a state checkpoint
    only at 3 blocks, so the second shares attention blocks but no checkpoint, a miss anywhere.
    The router still sends it to the engine holding those blocks, where vLLM then keeps a
    checkpoint at the 2 blocks they share (its shared-prefix junction): a third prompt
    sharing them hits there, and equals the colocated engine without cache. Routed blind, the
    second would go to the other engine half the time and the third would miss."""
    from router import metrics

    dep, orchestrator = deployment
    shared = cases["longer"].request("junction").prompt_token_ids[: 2 * block]
    salt = "junction"

    def ending(name: str, tail: tuple[int, ...]):
        request = cases["longer"].request(f"pd-{name}", cache_salt=salt)
        request = dataclasses.replace(request, prompt_token_ids=shared + tail)
        return run(asyncio.wait_for(collect(orchestrator.generate(request)), 120))

    lesson = _lesson()
    within = metrics.PREFIX_PREDICTIONS.labels("within 5%")._value.get()
    _, first = ending("junction-1", tuple(reversed(lesson[: block + 50])))
    holder = _member(dep, first.prefill_worker)
    hits_before, predicted = _prompt_tokens(holder).get("local_cache_hit", 0), _predicted()
    _, second = ending("junction-2", tuple(reversed(lesson[block + 50 : 2 * block + 100])))
    assert second.prefill_worker == holder.name and second.cached_tokens == 0 and _predicted() == predicted
    tokens, third = _generate(orchestrator, "junction-3", cases["longer"], cache_salt=salt)
    assert_matches(tokens, uncached["longer"])
    assert third.prefill_worker == holder.name and third.cached_tokens == 2 * block
    assert _predicted() - predicted == 2 * block
    assert _prompt_tokens(holder)["local_cache_hit"] - hits_before == 2 * block
    assert metrics.PREFIX_PREDICTIONS.labels("within 5%")._value.get() - within == 3  # the index was right
    assert_no_blocks_held(dep)


def test_a_prompt_sharing_a_checkpoint_mark_hits_on_its_first_repeat(deployment, uncached, cases, block):
    """Prefill's steps end every CHECKPOINT_BLOCKS blocks, each end's state kept: a prompt
    sharing a longer one's first CHECKPOINT_BLOCKS blocks, and not its last whole block,
    hits them at once, where vLLM's default (a checkpoint at the last whole block only) misses
    until a third prompt. It equals the colocated engine without cache."""
    dep, orchestrator = deployment
    marked, salt = cases["marked"], "marked"
    longer = Case(marked.offset, (CHECKPOINT_BLOCKS + 1) * block + 50)
    _, first = _generate(orchestrator, "marked-longer", longer, cache_salt=salt)
    holder = _member(dep, first.prefill_worker)
    predicted = _predicted()
    tokens, second = _generate(orchestrator, "marked", marked, cache_salt=salt)
    assert_matches(tokens, uncached["marked"])
    assert second.prefill_worker == holder.name and second.cached_tokens == CHECKPOINT_BLOCKS * block
    assert _predicted() - predicted == CHECKPOINT_BLOCKS * block
    assert_no_blocks_held(dep)


@pytest.mark.parametrize("name", ["inside", "one_past"])
def test_a_shorter_prompt_reuses_the_whole_blocks_it_shares(deployment, uncached, cases, block, name):
    """A prefix of the cached document that ends inside its third block, or one token past
    the second: 2 blocks reused, the rest (down to one token) computed."""
    dep, orchestrator = deployment
    _, holder = _generate(orchestrator, "document-again", cases["document"])  # whichever test runs alone
    predicted = _predicted()
    tokens, result = _generate(orchestrator, name, cases[name])
    assert_matches(tokens, uncached[name])
    assert result.prefill_worker == holder.prefill_worker and result.cached_tokens == 2 * block
    assert _predicted() - predicted == 2 * block
    assert_no_blocks_held(dep)


def test_a_conversation_hits_on_decode_and_pulls_less(deployment, uncached, cases, block):
    """Four turns of one conversation, two decode engines: decode filled whole blocks while
    answering, so the router sends the next turn to that engine, which finds them in its own
    cache, and NIXL moves only the rest and the state; every turn equals the colocated engine
    without cache."""
    dep, orchestrator = deployment
    decode, hits = None, 0
    for turn in range(1, TURNS + 1):
        name = f"turn{turn}"
        engines = [decode] if decode else dep.decode.members
        cached_before = {m.name: _prompt_tokens(m) for m in engines}
        bytes_before = {m.name: _nixl_bytes(m) for m in engines}
        tokens, result = _generate(orchestrator, name, cases[name])
        decode = decode or _member(dep, result.decode_worker)
        assert result.decode_worker == decode.name, f"turn {turn} left the engine holding the conversation"
        cached_before, bytes_before = cached_before[decode.name], bytes_before[decode.name]
        assert_matches(tokens, uncached[name])
        local_hit = _prompt_tokens(decode).get("local_cache_hit", 0) - cached_before.get("local_cache_hit", 0)
        pulled = _nixl_bytes(decode) - bytes_before
        handle = result.timings.transfer_bytes
        full = handle.attention_kv + handle.deltanet_state
        if local_hit:
            hits += 1
            assert turn > 1 and local_hit % block == 0
            assert 0 < pulled < full, (turn, pulled, full)
        else:
            assert pulled == pytest.approx(full, rel=0.05), (turn, pulled, full)
    assert hits >= TURNS - 1, "decode found no earlier turn in its cache"
    assert_no_blocks_held(dep)


def _both_prefilled_on_one_decode_engine(dep, limit: int, first, second, salt: str, reference, hit: int):
    """Conditional disaggregation (local_prefill_uncached `limit`): the `first` (name, Case)
    is prefilled on a decode engine, with no prefill leg; the `second` then on that engine
    from `hit` cached tokens, with nothing moved, equal to `reference`. Salted: it starts
    cold whichever test ran first."""
    from router.orchestrator import Orchestrator, RouterPolicy

    orchestrator = Orchestrator(dep.prefill, dep.decode, dep.limits, RouterPolicy(local_prefill_uncached=limit))
    try:
        _, result = _generate(orchestrator, *first, cache_salt=salt)
        assert result.prefill_worker == ""
        holder = _member(dep, result.decode_worker)
        hits_before, bytes_before = _prompt_tokens(holder).get("local_cache_hit", 0), _nixl_bytes(holder)
        tokens, again = _generate(orchestrator, *second, cache_salt=salt)
    finally:
        orchestrator.close()
    assert_matches(tokens, reference)
    assert again.prefill_worker == "" and again.decode_worker == holder.name
    assert again.cached_tokens == hit
    assert _prompt_tokens(holder)["local_cache_hit"] - hits_before == hit
    assert _nixl_bytes(holder) == bytes_before  # no handoff: nothing moved
    assert_no_blocks_held(dep)


def test_a_decode_engine_holding_the_prefix_prefills_the_rest_itself(deployment, uncached, cases, block):
    """Conditional disaggregation, local_prefill_uncached the document's length: the document
    is short enough to prefill on a decode engine (which keeps a state checkpoint at its last
    whole block, as prefill does), and the longer prompt sharing it then lacks less than that
    there: it is prefilled by that engine from its 2 cached blocks, with no prefill leg and
    nothing moved, and equals the colocated engine without cache."""
    from router import metrics

    dep, _ = deployment
    plans = metrics.PREFILL_PLANS
    short, held = plans.labels("short prompt")._value.get(), plans.labels("cached on decode")._value.get()
    document, longer = ("local-document", cases["document"]), ("local-longer", cases["longer"])
    limit = cases["document"].length
    _both_prefilled_on_one_decode_engine(dep, limit, document, longer, "local-prefill", uncached["longer"], 2 * block)
    assert plans.labels("short prompt")._value.get() == short + 1
    assert plans.labels("cached on decode")._value.get() == held + 1


def test_a_next_turn_resumes_where_its_decode_engine_decoded_past_a_block(deployment, uncached, cases, block):
    """Conditional disaggregation in a conversation: turn 1 (under a block) is prefilled on a
    decode engine, whose answer crosses the first block end, where decoding keeps a state
    checkpoint; turn 2 then lacks at most local_prefill_uncached there, so that engine
    computes only past that block, with no prefill leg and nothing moved, and equals the
    colocated engine without cache."""
    dep, _ = deployment
    turn1, turn2 = cases["turn1"], cases["turn2"]
    assert turn1.length < block < turn1.length + MAX_TOKENS
    limit = max(turn1.length, turn2.length - block)
    first, second = ("decoded-turn1", turn1), ("decoded-turn2", turn2)
    _both_prefilled_on_one_decode_engine(dep, limit, first, second, "decoded-past", uncached["turn2"], block)


def test_a_salted_prompt_shares_no_blocks_with_other_salts(deployment, uncached, cases, block):
    """vLLM's cache_salt through P/D: the cached document under another tenant's salt is a
    miss (and the router knows it), the same salt again a hit; the output is the same."""
    dep, orchestrator = deployment
    _generate(orchestrator, "document-unsalted", cases["document"])
    predicted = _predicted()
    tokens, first = _generate(orchestrator, "salted", cases["longer"], cache_salt="tenant-b")
    assert_matches(tokens, uncached["longer"])
    assert first.cached_tokens == 0 and _predicted() == predicted
    tokens, again = _generate(orchestrator, "salted-again", cases["longer"], cache_salt="tenant-b")
    assert_matches(tokens, uncached["longer"])
    assert again.prefill_worker == first.prefill_worker and again.cached_tokens == 2 * block
    assert _predicted() - predicted == 2 * block
    assert_no_blocks_held(dep)


async def _copy_forgot(orchestrator, member, request: GenerateRequest, timeout_s: float = 5.0) -> bool:
    """The router's copy of the engine's index holds none of the prompt (the engine's eviction
    events reached it)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        copies = orchestrator.prefix_copies
        hit = (await copies.hits([member], request.prompt_token_ids, request.cache_salt, False, 1.0))[member.name]
        if hit.attention_tokens == 0 or asyncio.get_running_loop().time() > deadline:
            return hit.attention_tokens == 0
        await asyncio.sleep(0.05)


def test_a_hit_evicted_between_routing_and_scheduling_is_computed_whole(deployment, uncached, cases, block):
    """The race a small cache under load runs: the router is told an engine holds the
    document, picks it, and before that engine schedules the prompt other prompts evict the
    document's blocks (here run at that point, through the router's question). vLLM then
    computes the whole prompt: the handoff and the tokens are right, the index drops the
    evicted blocks, and the prediction is scored over."""
    from router import metrics

    dep, orchestrator = deployment
    salt = "evicted"
    _, first = _generate(orchestrator, "evict-document", cases["document"], cache_salt=salt)
    holder = _member(dep, first.prefill_worker)
    release = dep.decode.members[0].actor.release_transfer
    filler_tokens = 6 * block
    fillers = dep.capacities[holder.name].kv_blocks // (filler_tokens // block) + 2

    async def evict() -> None:
        """Prompts that share nothing until the holder's cache has cycled through every block."""
        for i in range(fillers):
            filler = GenerateRequest(f"filler-{i}", prompt_of(7 + i, i, filler_tokens), SamplingConfig(max_tokens=1))
            result = await holder.actor.prefill.remote(dataclasses.replace(filler, cache_salt=f"filler-{i}"))
            await release.remote(result.handle)

    asked, evicted = orchestrator.cached_prefixes, []

    async def asked_then_evicted(pool, request, *args, **kwargs):  # noqa: ANN001, ANN202
        answers = await asked(pool, request, *args, **kwargs)
        if pool is dep.prefill and request.cache_salt == salt:
            assert answers[holder.name].tokens == 2 * block  # what the router is told
            await evict()
            evicted.append(await _copy_forgot(orchestrator, holder, request))
        return answers

    over = metrics.PREFIX_PREDICTIONS.labels("over")._value.get()
    orchestrator.cached_prefixes = asked_then_evicted
    try:
        tokens, result = _generate(orchestrator, "evict-longer", cases["longer"], cache_salt=salt)
    finally:
        del orchestrator.cached_prefixes
    assert_matches(tokens, uncached["longer"])
    assert result.prefill_worker == holder.name and result.cached_tokens == 0
    assert metrics.PREFIX_PREDICTIONS.labels("over")._value.get() == over + 1
    assert evicted == [True], "the router's copy of the holder's index still held the document after the fillers"
    assert_no_blocks_held(dep)
