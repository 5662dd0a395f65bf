"""vLLM's KV cache events, read into an engine's prefix index (vllm_engine.prefix_index).

vLLM publishes each block stored or evicted per KV-cache group (`kv_events_config`, ZMQ); the
engine's actor subscribes over an IPC socket in a private directory (no network listener).
Events come from the engine-core process on GPU (AsyncLLM) as on CPU, so this is the one view
that works on both paths. A gap in the event sequence asks vLLM's replay socket for what was
missed; if the replay cannot cover it the index starts again empty (it under-predicts until
blocks are stored again, never over).
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

from messages.reports import IndexChange
from vllm_engine.metrics import KV_EVENT_LAG, PREFIX_INDEX_BLOCKS, PREFIX_INDEX_RESYNCS
from vllm_engine.prefix_index import PrefixIndex

if TYPE_CHECKING:
    from vllm.config.kv_events import KVEventsConfig

log = logging.getLogger(__name__)

_POLL_MS = 100
_PREFIX = "pdserve-engine-ipc-"


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
                self._index.record(index_changes(batch.events))
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
                self._index.record(index_changes(batches[seq].events))
            return True
        except zmq.Again:
            return False
        finally:
            dealer.close(linger=0)


def index_changes(events: Sequence[Any]) -> list[IndexChange | None]:
    """vLLM's events (BlockStored, BlockRemoved, AllBlocksCleared: None) as the index takes them."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    changes: list[IndexChange | None] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            changes.append(None)
        elif isinstance(event, (BlockStored, BlockRemoved)):
            keys = tuple(event.block_hashes)
            changes.append(IndexChange(event.group_idx or 0, isinstance(event, BlockStored), keys))
    return changes


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
