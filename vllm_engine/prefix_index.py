"""Where a prompt's prefix lives on this engine: an index of its cached blocks, kept from
vLLM's own KV cache events, and the prompt tokens it would reuse.

vLLM publishes each block stored or evicted per KV-cache group (`kv_events_config`, ZMQ); the
engine's actor subscribes over an IPC socket in a private directory (no network listener) and
keeps one set of block hashes per group. Events come from the engine-core process on GPU
(AsyncLLM) as on CPU, so this is the one view that works on both paths. A gap in the event
sequence asks vLLM's replay socket for what was missed; if the replay cannot cover it the
index starts again empty (it under-predicts until blocks are stored again, never over).

A hybrid's hit needs every group: the attention blocks of each whole block up to the hit,
and a DeltaNet state checkpoint at its end (vLLM keeps those only at some block ends, align
mode). `PrefixIndex.hit` applies that rule as vLLM's scheduler does, including its cap: the
prompt's last token is always computed. A decode leg that pulls its state needs the attention
blocks alone: the producer's final state replaces any checkpoint.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from kv_transfer.layout import GroupKind, StateLayout
from messages.reports import PrefixHit
from vllm_engine.metrics import KV_EVENT_LAG, PREFIX_INDEX_BLOCKS, PREFIX_INDEX_RESYNCS

if TYPE_CHECKING:
    from vllm.config.kv_events import KVEventsConfig

log = logging.getLogger(__name__)

_POLL_MS = 100
_PREFIX = "pdserve-engine-ipc-"
# A block's hash as vLLM's events carry it: the low 64 bits as an int by default
# (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else the whole digest.
BlockKey = bytes | int


@dataclass(frozen=True, slots=True)
class EngineSockets:
    """One engine's IPC paths, in a directory only this user can enter: its KV cache events,
    and vLLM's own sockets (VLLM_RPC_BASE_PATH: AsyncLLM's engine core, TP ranks), which vLLM
    would otherwise leave in /tmp when the engine is killed."""

    directory: str

    @classmethod
    def private(cls) -> "EngineSockets":
        """A fresh directory (mode 0700) named for this process; those of processes that died
        without removing theirs (a killed actor) go first."""
        for stale in glob.glob(os.path.join(tempfile.gettempdir(), f"{_PREFIX}*")):
            pid = os.path.basename(stale)[len(_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        return cls(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))

    @property
    def endpoint(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'events')}"

    @property
    def replay_endpoint(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'replay')}"

    def process_env(self) -> dict[str, str]:
        return {"VLLM_RPC_BASE_PATH": self.directory}

    def kv_events_config(self) -> "KVEventsConfig":
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class PrefixIndex:
    """Block hashes cached per KV-cache group (vLLM's group index), as its events say."""

    def __init__(self) -> None:
        self._blocks: dict[int, set[BlockKey]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(blocks) for blocks in self._blocks.values())

    def apply(self, events: Sequence[Any]) -> None:
        """One batch of vLLM's events (BlockStored, BlockRemoved, AllBlocksCleared)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    self._blocks.clear()
                elif isinstance(event, BlockStored):
                    self._blocks.setdefault(event.group_idx or 0, set()).update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    self._blocks.get(event.group_idx or 0, set()).difference_update(event.block_hashes)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def hit(
        self, block_hashes: Sequence[BlockKey], prompt_tokens: int, layout: StateLayout, state_pulled: bool = False
    ) -> PrefixHit:
        """What the engine of `layout` holds of a prompt whose full blocks have these hashes.
        `state_pulled`: a decode leg that pulls the prompt's final state from a producer needs
        only the attention blocks (vLLM's NixlConnector reads the rest)."""
        block_size = layout.block_size
        usable = min(len(block_hashes), (prompt_tokens - 1) // block_size)
        with self._lock:
            held = [self._blocks.get(i, set()) for i in range(len(layout.groups))]
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


class EventSubscriber:
    """Reads one engine's event stream into a `PrefixIndex` on a thread of its own."""

    def __init__(self, sockets: EngineSockets, index: PrefixIndex) -> None:
        self._sockets = sockets
        self._index = index
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._thread.join(timeout=2)

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self._sockets.endpoint)
        expected = 0  # a batch published before this socket joined is replayed
        try:
            while self._running:
                if not sub.poll(_POLL_MS):
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > expected and not self._replay(context, decoder, expected, seq):
                    PREFIX_INDEX_RESYNCS.inc()
                    log.warning("KV events %d-%d lost and not replayed: prefix index restarts", expected, seq - 1)
                    self._index.clear()
                batch = decoder.decode(payload)
                self._index.apply(batch.events)
                KV_EVENT_LAG.observe(max(0.0, time.time() - batch.ts))
                PREFIX_INDEX_BLOCKS.set(len(self._index))
                expected = seq + 1
        finally:
            sub.close(linger=0)

    def _replay(self, context: Any, decoder: Any, start: int, until: int) -> bool:
        """Batches [start, until) from vLLM's replay socket; False if it no longer has them."""
        import zmq

        dealer = context.socket(zmq.DEALER)  # vLLM's ROUTER answers one request with many frames
        dealer.setsockopt(zmq.RCVTIMEO, 2000)
        dealer.connect(self._sockets.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            batches: dict[int, Any] = {}
            while True:
                _, _, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq < 0:  # vLLM's end-of-replay marker
                    break
                if seq < until:
                    batches[seq] = decoder.decode(payload)
            if set(batches) != set(range(start, until)):
                return False
            for seq in range(start, until):
                self._index.apply(batches[seq].events)
            return True
        except zmq.Again:
            return False
        finally:
            dealer.close(linger=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str = "", hash_algo: str = "sha256"
) -> list[BlockKey]:
    """The hashes vLLM gives this prompt's full blocks, by its own function (and NONE_HASH
    seed, derived in this process as the engine derives it: same rule, same environment), in
    the form its events carry them. A salt is the first block's extra key, as vLLM keys it."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    hash_fn = get_hash_fn_by_name(hash_algo)
    if not hasattr(kv_cache_utils, "NONE_HASH"):  # the engine core runs in another process
        kv_cache_utils.init_none_hash(hash_fn)
    hashes: list[BlockKey] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
        parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size], extra)
        hashes.append(kv_cache_utils.maybe_convert_block_hash(parent))
    return hashes
