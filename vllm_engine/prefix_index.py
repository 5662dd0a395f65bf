"""Where a prompt's prefix lives on an engine: an index of its cached blocks per KV-cache
group, and the prompt tokens it would reuse.

The engine's actor keeps one from vLLM's KV cache events (vllm_engine.kv_events) and logs its
changes; each router keeps a copy of it, followed from that log (router/prefix_copies.py),
and hashes a prompt as vLLM does (`BlockHashing`), so routing asks no engine anything.
Nothing here imports vLLM at module level: routers load this module and never load vLLM.

A hybrid's hit needs every group: the attention blocks of each whole block up to the hit,
and a DeltaNet state checkpoint at its end (vLLM keeps those only at some block ends, align
mode). `PrefixIndex.hit` applies that rule as vLLM's scheduler does, including its cap: the
prompt's last token is always computed. A decode leg that pulls its state needs the attention
blocks alone: the producer's final state replaces any checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import pickle
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kv_transfer.layout import GroupKind, StateLayout
from messages.reports import BlockKey, IndexChange, PrefixHit, PrefixIndexUpdate

# Event batches an engine's index remembers for copies that fell behind: beyond them a copy
# is sent the whole index (one batch per engine step that stored or evicted blocks).
_HISTORY = 4096
_LOW_64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class BlockHashing:
    """How an engine names its blocks in its KV cache events: vLLM's hash of each full block,
    chained from the seed block NONE_HASH, of (parent, tokens, extra keys: the cache salt on
    the first block); the low 64 bits as an int where vLLM's events carry ints. Computed here
    as vLLM 0.32 computes it (vllm/v1/core/kv_cache_utils.py hash_block_tokens), so that a
    router, which does not load vLLM, hashes a prompt as the engine does;
    tests/test_prefix_index.py checks it against vLLM's own function, tests/test_prefix_reuse.py
    against a real engine's events."""

    algo: str  # vLLM's prefix_caching_hash_algo: "sha256" (pickle) or "sha256_cbor"
    none_hash: bytes
    int_keys: bool
    block_size: int

    def __post_init__(self) -> None:
        if self.algo not in _SERIALIZERS:
            raise ValueError(
                f"prefix_caching_hash_algo {self.algo!r}: routers reproduce 'sha256' and 'sha256_cbor' "
                "(xxhash seeds each engine process at random)"
            )

    @classmethod
    def of_engine(cls, block_size: int, algo: str = "sha256") -> BlockHashing:
        """The engine's, derived by vLLM's own rule in this process (the engine core derives it
        from the same environment: PYTHONHASHSEED, else vLLM's fixed seed)."""
        from vllm import envs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

        hash_fn = get_hash_fn_by_name(algo)
        none_hash = hash_fn(resolve_none_hash_seed(hash_fn))
        return cls(algo, none_hash, bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), block_size)

    def hashes(self, token_ids: Sequence[int], cache_salt: str = "") -> list[BlockKey]:
        """The keys of the prompt's full blocks, in order."""
        serialize = _SERIALIZERS[self.algo]
        keys: list[BlockKey] = []
        parent = self.none_hash
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
            parent = hashlib.sha256(serialize((parent, tuple(token_ids[start : start + size]), extra))).digest()
            keys.append(int.from_bytes(parent, "big") & _LOW_64 if self.int_keys else parent)
        return keys


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    import cbor2

    return cbor2.dumps(value, canonical=True)


# What vLLM's "sha256" and "sha256_cbor" hash (vllm/utils/hashing.py).
_SERIALIZERS: dict[str, Callable[[Any], bytes]] = {"sha256": _pickled, "sha256_cbor": _cbor}


class PrefixIndex:
    """Block keys held per KV-cache group (vLLM's group index), each with its count of copies.

    vLLM caches a block again when a request recomputes it: a hybrid's prompt that hits only
    up to an earlier state checkpoint recomputes attention blocks the engine already holds,
    and both copies stay cached under one hash. Evicting either emits BlockRemoved for that
    hash, so a key is held until as many removals as stores have come.

    An engine's index `record`s its events and remembers the latest batches, so a copy asks
    only for what changed (`changes_since`); a copy `follow`s those updates. `generation`
    changes whenever the index starts again (a clear), so a copy of an older one is sent the
    whole index."""

    def __init__(self) -> None:
        self._blocks: dict[int, Counter[BlockKey]] = {}
        self._lock = threading.Lock()
        self.generation = uuid.uuid4().hex
        self.version = 0
        self._log: deque[tuple[int, tuple[IndexChange, ...]]] = deque(maxlen=_HISTORY)
        # Long polls wait on this event, on their (the actor's) loop; the recording thread sets it
        # only while one waits: each wake-up takes the engine's core and GIL from its steps.
        self._change: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._waiting = 0

    def __len__(self) -> int:
        with self._lock:
            return sum(len(blocks) for blocks in self._blocks.values())

    def record(self, changes: Sequence[IndexChange | None]) -> None:
        """One batch of the engine's events, in order; None: every block was cleared."""
        with self._lock:
            batch: list[IndexChange] = []
            for change in changes:
                if change is None:
                    self._restart()
                    batch.clear()
                else:
                    self._apply(change)
                    batch.append(change)
            self.version += 1
            self._log.append((self.version, tuple(batch)))
            wake = self._waiting > 0
        if wake:
            self._changed()

    def clear(self) -> None:
        with self._lock:
            self._restart()
            wake = self._waiting > 0
        if wake:
            self._changed()

    def changes_since(self, generation: str, version: int) -> PrefixIndexUpdate | None:
        """What a copy at (`generation`, `version`) lacks; None if nothing."""
        with self._lock:
            if generation == self.generation:
                if version == self.version:
                    return None
                oldest = self._log[0][0] if self._log else self.version + 1
                if oldest <= version + 1 <= self.version + 1:  # the log's versions run on by one
                    newer = itertools.islice(self._log, version + 1 - oldest, None)
                    changes = tuple(c for _, batch in newer for c in batch)
                    return PrefixIndexUpdate(self.generation, self.version, False, changes)
            held = tuple(IndexChange(group, True, tuple(keys.elements())) for group, keys in self._blocks.items())
            return PrefixIndexUpdate(self.generation, self.version, True, held)

    async def changes_after(self, generation: str, version: int, wait_s: float) -> PrefixIndexUpdate | None:
        """`changes_since`, waiting up to `wait_s` for a change if there is none yet (a long
        poll, on the one event loop its callers share: the engine actor's)."""
        if self._change is None:
            self._change = (asyncio.get_running_loop(), asyncio.Event())
        changed = self._change[1]
        deadline = time.monotonic() + wait_s
        while (update := self.changes_since(generation, version)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            changed.clear()
            with self._lock:
                self._waiting += 1
            try:
                if (update := self.changes_since(generation, version)) is not None:
                    break  # it changed between the two looks
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), remaining)
            finally:
                with self._lock:
                    self._waiting -= 1
        return update

    def follow(self, update: PrefixIndexUpdate) -> None:
        """Apply an update of the index this one copies (from its `changes_since`)."""
        with self._lock:
            if update.whole:
                self._blocks.clear()
            for change in update.changes:
                self._apply(change)
            self.generation, self.version = update.generation, update.version

    def hit(
        self, block_hashes: Sequence[BlockKey], prompt_tokens: int, layout: StateLayout, state_pulled: bool = False
    ) -> PrefixHit:
        """What the engine of `layout` holds of a prompt whose full blocks have these hashes.
        `state_pulled`: a decode leg that pulls the prompt's final state from a producer needs
        only the attention blocks (vLLM's NixlConnector reads the rest)."""
        block_size = layout.block_size
        usable = min(len(block_hashes), (prompt_tokens - 1) // block_size)
        with self._lock:
            held = [self._blocks.get(i, Counter()) for i in range(len(layout.groups))]
            attention = [b for b, g in zip(held, layout.groups) if g.kind is GroupKind.ATTENTION]
            states = [b for b, g in zip(held, layout.groups) if g.kind is GroupKind.DELTANET]
            run = 0
            while run < usable and all(block_hashes[run] in blocks for blocks in attention):
                run += 1
            if state_pulled:
                return PrefixHit(run * block_size, run * block_size)
            for hit in range(run, 0, -1):  # the last block end that holds every state
                if all(block_hashes[hit - 1] in blocks for blocks in states):
                    return PrefixHit(hit * block_size, run * block_size)
        return PrefixHit(0, run * block_size)

    def _apply(self, change: IndexChange) -> None:
        held = self._blocks.setdefault(change.group, Counter())
        if change.stored:
            held.update(change.keys)
            return
        for key in change.keys:  # a removal of a key never seen (before a resync) is ignored
            if held[key] > 1:
                held[key] -= 1
            else:
                held.pop(key, None)

    def _restart(self) -> None:
        self._blocks.clear()
        self._log.clear()
        self.generation, self.version = uuid.uuid4().hex, 0

    def _changed(self) -> None:
        if self._change is not None:
            loop, changed = self._change
            with contextlib.suppress(RuntimeError):  # the loop closed: its process is going
                loop.call_soon_threadsafe(changed.set)
