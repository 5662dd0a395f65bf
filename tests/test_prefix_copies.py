"""A router's copies of the engines' prefix indexes (router/prefix_copies.py), against stand-in
engines: real Ray actors with an engine actor's index surface and no engine. A stored block
reaches the copy by the long poll; an engine that restarted is copied again whole; one out
of reach, or whose copy is still starting, counts as holding nothing. Real engines (vLLM's
events and hashes, an eviction seen by the copy) run in tests/test_prefix_reuse.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from cluster.pools import Member
from kv_transfer.layout import CacheGroup, GroupKind, StateLayout
from messages.reports import IndexChange, PrefixHit, PrefixIndexUpdate
from router import metrics
from router.prefix_copies import PrefixCopies
from vllm_engine.prefix_index import BlockHashing, PrefixIndex

BLOCK = 4
HASHING = BlockHashing("sha256", b"seed", int_keys=True, block_size=BLOCK)
LAYOUT = StateLayout((CacheGroup(GroupKind.ATTENTION, 2, 64, BLOCK),), num_blocks=64)
PROMPT = tuple(range(1, 18))  # 4 whole blocks and a token


@ray.remote(num_cpus=0)
class IndexOnly:
    """EngineWorker's prefix-index surface over a PrefixIndex that `store` fills as vLLM's
    events would."""

    def __init__(self, spec_delay_s: float = 0.0) -> None:
        self.index = PrefixIndex()
        self.spec_delay_s = spec_delay_s
        self.answered = 0  # long polls answered with changes

    def store(self, blocks: int) -> None:
        self.index.record([IndexChange(0, True, tuple(HASHING.hashes(PROMPT)[:blocks]))])

    async def store_one_by_one(self, blocks: int, gap_s: float) -> None:
        """Each of the prompt's first `blocks` blocks in a batch of its own, `gap_s` apart, as
        an engine's steps store them."""
        keys = HASHING.hashes(PROMPT)[:blocks]
        for key in keys:
            self.index.record([IndexChange(0, True, (key,))])
            await asyncio.sleep(gap_s)

    def polls_answered(self) -> int:
        return self.answered

    async def prefix_index_spec(self) -> tuple[BlockHashing, StateLayout]:
        await asyncio.sleep(self.spec_delay_s)
        return HASHING, LAYOUT

    async def prefix_index_changes(self, generation: str, version: int, wait_s: float) -> PrefixIndexUpdate | None:
        update = await self.index.changes_after(generation, version, wait_s)
        self.answered += update is not None
        return update


def _member(name: str, actor) -> Member:  # noqa: ANN001
    member = Member(name, actor)
    member.mark_live()
    return member


def _hits(copies: PrefixCopies, members: list[Member], wait_s: float = 1.0) -> dict[str, PrefixHit]:
    return asyncio.run(copies.hits(members, PROMPT, "", False, wait_s))


def _until(copies: PrefixCopies, members: list[Member], want: dict[str, PrefixHit], timeout_s: float = 5.0) -> float:
    """Seconds until the copies answer `want`."""
    started = time.monotonic()
    while (hits := _hits(copies, members)) != want:
        assert time.monotonic() - started < timeout_s, hits
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
def copies():
    copies = PrefixCopies()
    yield copies
    copies.close()


def test_a_stored_block_reaches_the_copy_and_a_restarted_engine_is_copied_whole(ray_cluster, copies):
    a, b = _member("e0", IndexOnly.remote()), _member("e1", IndexOnly.remote())
    ray.get([a.actor.store.remote(2), b.actor.store.remote(1)])  # before the copies start: sent whole
    assert _until(copies, [a, b], {"e0": PrefixHit(8, 8), "e1": PrefixHit(4, 4)}) < 1.0
    ray.get(a.actor.store.remote(3))  # a change while the copy's long poll waits
    assert _until(copies, [a, b], {"e0": PrefixHit(12, 12), "e1": PrefixHit(4, 4)}) < 0.5
    ray.kill(a.actor)  # out of reach: it holds nothing, and is not waited for
    _until(copies, [a, b], {"e1": PrefixHit(4, 4)})
    a.actor = IndexOnly.remote()  # the engine restarted with an empty cache, then stored a block
    ray.get(a.actor.store.remote(1))
    _until(copies, [a, b], {"e0": PrefixHit(4, 4), "e1": PrefixHit(4, 4)})


def test_an_engine_whose_copy_is_starting_counts_as_holding_nothing(ray_cluster, copies):
    slow = _member("slow", IndexOnly.remote(spec_delay_s=2.0))
    ray.get(slow.actor.store.remote(4))
    unready = metrics.PREFIX_COPIES_UNREADY._value.get()
    assert _hits(copies, [slow], wait_s=0.05) == {}
    assert metrics.PREFIX_COPIES_UNREADY._value.get() == unready + 1
    assert _until(copies, [slow], {"slow": PrefixHit(16, 16)}) < 3.0  # the prompt's last token is computed


def test_changes_coming_step_after_step_reach_the_copy_in_fewer_polls(ray_cluster, copies, monkeypatch):
    """Each answer wakes the engine actor's loop, beside its steps: the copy spaces its polls
    and takes the changes of several steps in one."""
    monkeypatch.setattr("router.prefix_copies._POLL_GAP_S", 0.5)
    engine = _member("e0", IndexOnly.remote())
    _until(copies, [engine], {"e0": PrefixHit()})  # following, nothing stored yet
    while (answered := ray.get(engine.actor.polls_answered.remote())) < 1:  # the whole index, at start
        time.sleep(0.01)
    ray.get(engine.actor.store_one_by_one.remote(4, 0.02))  # four steps' batches within ~0.1 s
    _until(copies, [engine], {"e0": PrefixHit(16, 16)}, timeout_s=3.0)
    assert ray.get(engine.actor.polls_answered.remote()) - answered <= 2  # not one per batch
