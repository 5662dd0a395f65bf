"""The prefix index's hybrid rule on vLLM's own event types, a router's copy of it, prompt
hashing against vLLM's own function, and the prefill pick that reads it (fast: no engine).
The index against a real engine's events and hashes, and the router's pick through its copy,
run in tests/test_prefix_reuse.py."""

from __future__ import annotations

import asyncio

import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from cluster.pools import Member, Pool
from kv_transfer.layout import CacheGroup, GroupKind, StateLayout
from messages.reports import PrefixHit
from router.orchestrator import RouterPolicy
from vllm_engine.kv_events import index_changes
from vllm_engine.prefix_index import BlockHashing, PrefixIndex

BLOCK = 4
# vLLM's group order for the embedded hybrid: three DeltaNet groups, then attention.
LAYOUT = StateLayout(
    (
        CacheGroup(GroupKind.DELTANET, 2, 100, 0),
        CacheGroup(GroupKind.DELTANET, 2, 100, 0),
        CacheGroup(GroupKind.DELTANET, 2, 100, 0),
        CacheGroup(GroupKind.ATTENTION, 2, 64, BLOCK),
    ),
    num_blocks=64,
)
HASHES = [101, 102, 103, 104]  # a 4-block prompt's block hashes, as vLLM's events carry them


def _stored(hashes: list[int], group: int) -> BlockStored:
    return BlockStored(hashes, None, [], BLOCK, None, None, None, group_idx=group)


def _index(attention: list[int], states: list[int]) -> PrefixIndex:
    index = PrefixIndex()
    index.record(index_changes([_stored(attention, 3), *(_stored(states, g) for g in range(3))]))
    return index


def test_a_hit_ends_at_the_last_block_end_with_every_state():
    # Attention holds 3 blocks; a DeltaNet checkpoint exists only after block 2.
    assert _index(HASHES[:3], [HASHES[1]]).hit(HASHES, 17, LAYOUT) == PrefixHit(2 * BLOCK, 3 * BLOCK)


def test_a_checkpoint_beyond_the_attention_blocks_is_no_hit():
    assert _index(HASHES[:1], [HASHES[2]]).hit(HASHES, 17, LAYOUT).tokens == 0


def test_a_checkpoint_missing_in_one_state_group_is_no_hit():
    index = _index(HASHES, [])
    index.record(index_changes([_stored([HASHES[3]], 0), _stored([HASHES[3]], 1)]))  # not group 2
    assert index.hit(HASHES, 17, LAYOUT).tokens == 0


def test_the_prompts_last_token_is_always_computed():
    # A 16-token prompt (4 whole blocks, all cached) reuses 3 blocks, as vLLM's scheduler does.
    assert _index(HASHES, HASHES).hit(HASHES, 16, LAYOUT).tokens == 3 * BLOCK


def test_removals_and_clears_take_blocks_out():
    index = _index(HASHES, HASHES)
    index.record(index_changes([BlockRemoved([HASHES[1]], None, group_idx=3)]))  # an attention block evicted
    assert index.hit(HASHES, 17, LAYOUT).tokens == BLOCK
    index.record(index_changes([AllBlocksCleared()]))
    assert index.hit(HASHES, 17, LAYOUT).tokens == 0 and len(index) == 0


def test_a_block_cached_twice_is_held_until_both_copies_are_evicted():
    # A hybrid prompt hitting only up to an earlier checkpoint recomputes attention blocks the
    # engine holds; vLLM caches them again under the same hash and removes each copy apart.
    index = _index(HASHES, HASHES)
    index.record(index_changes([_stored(HASHES[1:], 3)]))  # the second copies
    index.record(index_changes([BlockRemoved(HASHES[1:], None, group_idx=3)]))  # the first ones evicted
    assert index.hit(HASHES, 17, LAYOUT).tokens == 4 * BLOCK
    copy = PrefixIndex()
    assert _copied(index, copy) == "whole"  # a whole copy carries the counts too
    index.record(index_changes([BlockRemoved(HASHES[1:], None, group_idx=3)]))
    assert _copied(index, copy) == "delta" and copy.hit(HASHES, 17, LAYOUT).tokens == BLOCK
    index.record(index_changes([BlockRemoved([999], None, group_idx=3)]))  # never stored: ignored
    assert len(index) == 4 * 3 + 1


def _copied(index: PrefixIndex, copy: PrefixIndex) -> str:
    """Bring `copy` up to `index` as a router does; how: "delta", "whole" or "current"."""
    update = index.changes_since(copy.generation, copy.version)
    if update is None:
        return "current"
    copy.follow(update)
    assert copy.hit(HASHES, 17, LAYOUT) == index.hit(HASHES, 17, LAYOUT)
    assert (copy.generation, copy.version, len(copy)) == (index.generation, index.version, len(index))
    return "whole" if update.whole else "delta"


def test_a_copy_follows_changes_and_starts_again_whole(monkeypatch):
    index, copy = _index(HASHES, HASHES), PrefixIndex()
    assert _copied(index, copy) == "whole"  # a new copy: another generation
    assert _copied(index, copy) == "current"
    index.record(index_changes([BlockRemoved([HASHES[2]], None, group_idx=3)]))
    index.record(index_changes([_stored([HASHES[2]], 3), BlockRemoved([HASHES[3]], None, group_idx=1)]))
    assert _copied(index, copy) == "delta" and copy.hit(HASHES, 17, LAYOUT) == PrefixHit(3 * BLOCK, 4 * BLOCK)
    index.record(index_changes([AllBlocksCleared(), _stored(HASHES[:1], 3)]))  # the engine's cache cleared
    assert _copied(index, copy) == "whole" and copy.hit(HASHES, 17, LAYOUT) == PrefixHit(0, BLOCK)
    index.clear()  # events lost and not replayed: the index restarts empty
    assert _copied(index, copy) == "whole" and len(copy) == 0
    monkeypatch.setattr("vllm_engine.prefix_index._HISTORY", 2)
    index, copy = PrefixIndex(), PrefixIndex()
    _copied(index, copy)
    for h in HASHES:  # more batches than the index remembers: the copy is sent it whole
        index.record(index_changes([_stored([h], 3)]))
    assert _copied(index, copy) == "whole"


def test_a_copy_behind_is_sent_exactly_the_batches_it_lacks(monkeypatch):
    monkeypatch.setattr("vllm_engine.prefix_index._HISTORY", 3)
    index, copy = PrefixIndex(), PrefixIndex()
    _copied(index, copy)
    for h in HASHES[:3]:
        index.record(index_changes([_stored([h], 3)]))
    _copied(index, copy)  # at version 3; the log remembers versions 1-3
    index.record(index_changes([_stored([HASHES[3]], 3)]))  # version 4; the log holds 2-4
    update = index.changes_since(copy.generation, copy.version)
    assert update is not None and not update.whole
    assert [change.keys for change in update.changes] == [(HASHES[3],)]
    assert _copied(index, copy) == "delta"


def test_a_change_wakes_a_waiting_long_poll_and_no_loop_otherwise(monkeypatch):
    index, woken = PrefixIndex(), []
    wake = index._changed
    monkeypatch.setattr(index, "_changed", lambda: (woken.append(1), wake()))

    async def poll_then_record() -> tuple[float, object]:
        asyncio.get_running_loop().call_later(0.05, index.record, index_changes([_stored([HASHES[0]], 3)]))
        started = asyncio.get_running_loop().time()
        update = await index.changes_after(index.generation, index.version, 5.0)
        return asyncio.get_running_loop().time() - started, update

    index.record(index_changes([_stored([HASHES[1]], 3)]))  # no long poll has ever waited
    index.changes_since(index.generation, 0)
    assert woken == []
    waited, update = asyncio.run(poll_then_record())
    assert update is not None and waited < 2.0 and woken == [1]
    index.record(index_changes([_stored([HASHES[2]], 3)]))  # the poll has returned: nothing waits
    assert woken == [1]


def _vllms_hashes(token_ids: list[int], block_size: int, cache_salt: str, algo: str) -> list:
    """vLLM's own: hash_block_tokens from NONE_HASH, with the extra keys vLLM gives a salt."""
    from vllm import envs
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size], extra)
        hashes.append(kv_cache_utils.maybe_convert_block_hash(parent))
    assert isinstance(hashes[0], int) == bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    return hashes


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_a_router_hashes_a_prompt_as_vllm_does(algo, salt):
    tokens = [(i * 7919) % 50_000 for i in range(1000)]  # 3 whole 256-token blocks and a partial one
    hashing = BlockHashing.of_engine(256, algo)
    assert hashing.hashes(tokens, salt) == _vllms_hashes(tokens, 256, salt, algo)
    assert len(hashing.hashes(tokens, salt)) == 3
    assert hashing.hashes(tokens, salt) != hashing.hashes(tokens, "another salt")


def test_a_hashing_routers_cannot_reproduce_is_refused():
    with pytest.raises(ValueError, match="xxhash"):
        BlockHashing("xxhash", b"seed", True, 256)


def _member(name: str) -> Member:
    member = Member(name, None)
    member.mark_live()
    return member


def test_prefill_goes_where_the_least_work_is_left():
    pool = Pool("prefill", [_member("p0"), _member("p1")])
    cached = {"p0": PrefixHit(), "p1": PrefixHit(1500, 1500)}

    async def picks() -> list[str]:
        async with pool.in_flight(pool.members[1], prompt_tokens=300):
            # p1 holds 1,500 of a 2,000-token prompt with 300 queued: 800 tokens of work, not 2,000.
            first = pool.pick_prefill(2000, cached)
            assert first.cached_tokens == 1500
            async with pool.in_flight(pool.members[1], prompt_tokens=1500):  # now 2,300 behind the hit
                second = pool.pick_prefill(2000, cached)
        return [first.member.name, second.member.name]

    assert asyncio.run(picks()) == ["p1", "p0"]
    assert pool.pick_prefill(2000).cached_tokens is None  # nobody was asked


def test_an_engine_that_prefills_the_prompt_itself_is_picked_by_work_not_by_requests():
    # Colocated: the decode engines compute prompts. Both hold the first 256 tokens' attention
    # blocks, d1 the next 256 too (no DeltaNet checkpoint: neither hit is usable) and it is
    # still computing a 1,700-token prompt. Counting requests, d1 is within the slack and wins
    # on its longer attention prefix: the new prompt would wait behind that prefill.
    decode = Pool("decode", [_member("d0"), _member("d1")])
    cached = {"d0": PrefixHit(0, 256), "d1": PrefixHit(0, 512)}

    async def picks() -> list[str]:
        async with decode.in_flight(decode.members[1], prompt_tokens=1700) as busy:
            by_requests = decode.pick_decode(cached, slack=1).member.name
            by_work = decode.pick_prefill(2000, cached).member.name
            busy.prefilled()  # its first token: by the prompt's work alone, a decoding stream weighs nothing
            after = decode.pick_prefill(2000, cached).member.name
        return [by_requests, by_work, after]

    assert asyncio.run(picks()) == ["d1", "d0", "d1"]


def test_streams_decoding_on_an_engine_weigh_against_a_small_hit_there_not_a_large_one():
    # Colocated, a 1,900-token prompt: d0 holds its first 256 tokens (a shared system prompt),
    # d1 nothing. Counting the prompt's work alone, d0 takes it even with streams decoding
    # there, which the prefill would hold: every such request went to one engine. Weighing
    # each stream by the stall it would take, the idle engine wins; a 1,536-token document
    # hit still draws the request to the engine holding it.
    decode = Pool("decode", [_member("d0"), _member("d1")])
    system_prompt = {"d0": PrefixHit(256, 256), "d1": PrefixHit()}
    document = {"d0": PrefixHit(1536, 1536), "d1": PrefixHit()}

    async def picks() -> list[str]:
        names = [decode.pick_prefill(1900, system_prompt, stream_weight=1.0).member.name]  # both idle
        async with decode.in_flight(decode.members[0], prompt_tokens=1644) as stream:
            stream.prefilled()  # decoding now
            names.append(decode.pick_prefill(1900, system_prompt, stream_weight=0.0).member.name)
            names.append(decode.pick_prefill(1900, system_prompt, stream_weight=1.0).member.name)
            async with decode.in_flight(decode.members[0]):
                names.append(decode.pick_prefill(1664, document, stream_weight=1.0).member.name)
        return names

    assert asyncio.run(picks()) == ["d0", "d0", "d1", "d0"]


def test_at_the_default_weight_a_popular_document_spreads_to_an_idle_engine():
    # RAG: a ~1,840-token prompt, its first 1,536 tokens a document d0 holds. With one stream
    # decoding on d0 it stays there (a hit beats a whole document's prefill); with two, the
    # idle engine takes it and holds the document too. At weight 1 it stayed on d0 until six
    # streams decoded there, so one engine took nearly every request for it.
    decode = Pool("decode", [_member("d0"), _member("d1")])
    document = {"d0": PrefixHit(1536, 1536), "d1": PrefixHit()}
    weight = RouterPolicy().decoding_stream_weight

    async def picks() -> list[str]:
        names = []
        async with decode.in_flight(decode.members[0]) as first:
            first.prefilled()
            names.append(decode.pick_prefill(1840, document, weight).member.name)
            async with decode.in_flight(decode.members[0]) as second:
                second.prefilled()
                names.append(decode.pick_prefill(1840, document, weight).member.name)
                names.append(decode.pick_prefill(1840, document, 1.0).member.name)
        return names

    assert asyncio.run(picks()) == ["d0", "d1", "d0"]


def test_decode_goes_to_the_engine_holding_the_conversation_unless_it_is_busier():
    pool = Pool("decode", [_member("d0"), _member("d1")])
    cached = {"d0": PrefixHit(), "d1": PrefixHit(512, 512)}

    async def picks() -> list[str]:
        names = [pool.pick_decode(cached, slack=1).member.name]  # both idle: the hit wins
        async with pool.in_flight(pool.members[1]):
            names.append(pool.pick_decode(cached, slack=1).member.name)  # one more request: still it
            async with pool.in_flight(pool.members[1]):
                names.append(pool.pick_decode(cached, slack=1).member.name)  # two more: the idle one
        return names

    assert asyncio.run(picks()) == ["d1", "d1", "d0"]
    assert pool.pick_decode().cached_tokens is None


def test_of_equal_work_the_engine_holding_the_attention_prefix_wins():
    # Neither holds a DeltaNet checkpoint for the prompt, so both compute it all; the one with
    # the attention blocks keeps a checkpoint at their end (vLLM's shared-prefix junction),
    # so the next request sharing the prefix hits there. Blind to it, picks would alternate.
    cached = {"e0": PrefixHit(), "e1": PrefixHit(0, 1536)}
    prefill = Pool("prefill", [_member("e0"), _member("e1")])
    decode = Pool("decode", [_member("e0"), _member("e1")])
    assert {prefill.pick_prefill(2000, cached).member.name for _ in range(4)} == {"e1"}
    assert {decode.pick_decode(cached, slack=1).member.name for _ in range(4)} == {"e1"}

    # Once a request's work differs, the least work wins: the junction only breaks ties.
    async def busy() -> str:
        async with prefill.in_flight(prefill.members[1], prompt_tokens=100):
            return prefill.pick_prefill(2000, cached).member.name

    assert asyncio.run(busy()) == "e0"


def test_a_hit_never_exceeds_its_attention_blocks():
    with pytest.raises(ValueError, match="tokens <= attention_tokens"):
        PrefixHit(512, 256)


def test_a_decode_leg_that_pulls_its_state_needs_the_attention_blocks_alone():
    index = _index(HASHES[:3], [])  # no DeltaNet checkpoint anywhere
    assert index.hit(HASHES, 17, LAYOUT).tokens == 0
    assert index.hit(HASHES, 17, LAYOUT, state_pulled=True).tokens == 3 * BLOCK


def test_engine_socket_directories_of_dead_processes_are_swept(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys
    import tempfile

    from vllm_engine.kv_events import EngineSockets

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"pdserve-engine-ipc-{dead.stdout.strip()}-abc"
    stale.mkdir()
    mine = EngineSockets.private()
    assert not stale.exists() and os.path.basename(mine.directory).startswith(f"pdserve-engine-ipc-{os.getpid()}-")
    again = EngineSockets.private()  # a live process's directory stays
    assert os.path.isdir(mine.directory) and os.stat(mine.directory).st_mode & 0o777 == 0o700
    for sockets in (mine, again):
        sockets.remove()
    assert not os.path.exists(mine.directory)


@pytest.mark.parametrize(
    ("predicted", "cached", "outcome"),
    [(0, 0, "within 5%"), (512, 512, "within 5%"), (1000, 1040, "within 5%"), (256, 0, "over"), (0, 512, "under")],
)
def test_each_prediction_is_scored_against_what_the_engine_reused(predicted, cached, outcome):
    from router import metrics

    before = metrics.PREFIX_PREDICTIONS.labels(outcome)._value.get()
    metrics.observe_prediction(predicted, cached)
    assert metrics.PREFIX_PREDICTIONS.labels(outcome)._value.get() == before + 1
