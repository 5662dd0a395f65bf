"""What every worker role offers around its engine, whatever it does with requests: its
feeds to the routers among them (vllm_engine/feed.py), on which each role starts its legs."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable, ClassVar

import ray

from kv_transfer.connector import Connector
from kv_transfer.connector_config import Role, TransferConfig
from kv_transfer.consumer import TransferConsumer
from kv_transfer.layout import StateLayout
from kv_transfer.link_probe import ProbeSource
from kv_transfer.link_probe import read as read_probe
from kv_transfer.metrics import serve_metrics
from kv_transfer.producer import TransferProducer
from messages.reports import EngineCapacity, EngineLoad, PrefixIndexUpdate
from messages.requests import ModelLimits
from messages.results import AbortLeg, FeedAddress
from vllm_engine.config import EngineConfig
from vllm_engine.engine import Engine, EngineWiring, exit_for_restart, start_engine
from vllm_engine.feed import FeedCommands, FeedHub, FeedServer
from vllm_engine.kv_events import EngineSockets, EventSubscriber
from vllm_engine.prefix_index import BlockHashing, PrefixIndex
from vllm_engine.sizing import bf16_without_cpu_support


class EngineWorker:
    connector_role: ClassVar[Role]  # what a worker of this kind runs when it has a transfer
    engine_id: str  # NIXL identity; a restarted worker gets a new one
    _engine: Engine
    _config: EngineConfig
    _producer: TransferProducer | None
    _consumer: TransferConsumer | None
    _metrics_address: str = ""

    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        transfer: TransferConfig | None,
        host: str = "127.0.0.1",
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        """`transfer=None`: a colocated engine, without a connector. `host`: the worker's
        node address, where its NIXL side channel and its feeds listen."""
        self.name = name
        self._feeds = FeedHub()
        self._feed_server = FeedServer(self._feeds, host, self._feed_commands())
        self._config = engine_config
        self._transfer = transfer
        self._probe: ProbeSource | None = None
        self._sockets = EngineSockets.private()
        # Its KV cache events feed the prefix index routers copy (vllm_engine.prefix_index).
        caching = engine_config.enable_prefix_caching
        events_config = self._sockets.kv_events_config() if caching else None
        if transfer is None:
            if self.connector_role is not Role.DECODE:
                raise ValueError(f"a {self.connector_role.name.lower()} worker needs a TransferConfig")
            self.engine_id = f"colocated-{name}"
            wiring = EngineWiring(
                env=self._sockets.process_env(),
                on_fatal=on_fatal,
                stat_loggers=_stat_loggers(),
                kv_events_config=events_config,
            )
            self._engine = start_engine(engine_config, wiring)
            self._producer = self._consumer = None
        else:
            with Connector.for_worker(self.connector_role, name, transfer, host) as connector:
                self.engine_id = connector.engine_id
                wiring = EngineWiring(
                    connector.kv_transfer_config(),
                    {**connector.process_env(), **self._sockets.process_env()},
                    on_fatal,
                    _stat_loggers(),
                    events_config,
                )
                self._engine = start_engine(engine_config, wiring)
            self._producer, self._consumer = connector.halves(self._engine.prefill_backoff)
        self.limits: ModelLimits = self._engine.limits
        self._prefix_index: PrefixIndex | None = None
        if caching:
            self._prefix_index = PrefixIndex()
            self._subscriber = EventSubscriber(self._sockets, self._prefix_index)

    def ready(self) -> str:
        return self.engine_id

    async def feed_address(self) -> FeedAddress:
        """Where the feeds are: a router connects, starts its legs there and gets their
        outputs (a decode leg's tokens, a batch per engine step; a prefill leg's result)."""
        return await self._feed_server.address()

    def renew_feed(self, subscriber: str) -> None:
        """The subscriber is alive: keep its feed (and legs) going."""
        self._feeds.renew(subscriber)

    def abort_leg(self, leg_id: str) -> None:
        self._feeds.abort(leg_id)

    def _feed_commands(self) -> FeedCommands:
        """The commands a router may send on its feed here; each role adds the legs it runs."""
        return {AbortLeg: lambda _subscriber, command: self.abort_leg(command.leg_id)}

    def load(self) -> EngineLoad:
        """Cheap load report; carries the engine id so a router notices a restart, and when it
        was measured so a router can add only its requests started since."""
        return replace(
            self._engine.load(),
            engine_id=self.engine_id,
            metrics_address=self._metrics_address,
            measured_at=time.time(),
        )

    def model_limits(self) -> ModelLimits:
        return self.limits

    async def state_layout(self) -> StateLayout:
        return await self._engine.state_layout()

    async def capacity(self) -> EngineCapacity:
        """KV blocks, DeltaNet state slots and max-length requests this engine holds."""
        layout = await self._engine.state_layout()
        capacity = layout.capacity(
            self.limits.max_model_len, self._config.max_num_seqs, self._config.enable_prefix_caching
        )
        slow_bf16 = bf16_without_cpu_support(self._config.device, self._config.dtype)
        return replace(capacity, niceness=os.nice(0), bf16_without_cpu_support=slow_bf16)

    async def prefix_index_spec(self) -> tuple[BlockHashing, StateLayout] | None:
        """How a router hashes prompts for this engine and reads its index's groups (None with
        caching off: it holds nothing)."""
        if self._prefix_index is None:
            return None
        layout = await self._engine.state_layout()
        return BlockHashing.of_engine(layout.block_size), layout

    async def prefix_index_changes(self, generation: str, version: int, wait_s: float) -> PrefixIndexUpdate | None:
        """What a router's copy of this engine's prefix index at (`generation`, `version`)
        lacks; a long poll: waits up to `wait_s` for a change, None if none came."""
        if self._prefix_index is None:
            return None
        return await self._prefix_index.changes_after(generation, version, wait_s)

    def prefix_index_blocks(self) -> int:
        """Block hashes the prefix index holds, every KV-cache group counted."""
        return len(self._prefix_index) if self._prefix_index is not None else 0

    # ---- the start-up link probe (kv_transfer/link_probe.py) ----

    def _probe_backends(self) -> tuple[str, ...]:
        if self._transfer is None:
            raise RuntimeError(f"{self.name} is colocated: it moves no state, there is no link to measure")
        os.environ.update(self._transfer.process_env())  # the probe's agent reads UCX's settings as the engine's
        return self._transfer.nixl_backends

    def probe_offer(self, nbytes: int) -> bytes:
        """Register `nbytes` for one READ by a decode engine; returns what it needs to read them."""
        self._probe = ProbeSource(nbytes, self._probe_backends())
        return self._probe.offer

    async def probe_serve(self, timeout_s: float) -> bool:
        """Answer the READ of the offered buffer until it is done or `timeout_s` passes."""
        probe, self._probe = self._probe, None
        if probe is None:
            raise RuntimeError("probe_offer first")
        return await probe.serve(timeout_s)

    async def probe_read(self, offer: bytes, timeout_s: float) -> float:
        """READ a prefill engine's offered buffer once; the seconds it took."""
        return await read_probe(offer, self._probe_backends(), timeout_s)

    def engine_path(self) -> str:
        return self._config.path

    def pid(self) -> int:
        """The worker's process (benchmarks read its CPU time; fault tests signal it)."""
        return os.getpid()

    def metrics_address(self) -> str:
        """Where Prometheus scrapes this worker's metrics ("" when not exported)."""
        return self._metrics_address

    def shutdown(self) -> None:
        self._engine.shutdown()
        if self._prefix_index is not None:
            self._subscriber.stop()
        self._sockets.remove()


class InRayActor(EngineWorker):
    """Put first in a Ray actor's bases: the worker on its node's address, exiting for Ray
    to restart it when its engine fails, with its metrics exported."""

    def __init__(self, name: str, engine_config: EngineConfig, transfer: TransferConfig | None) -> None:
        node_ip = ray.util.get_node_ip_address()
        super().__init__(name, engine_config, transfer, node_ip, exit_for_restart)
        self._metrics_address = serve_metrics(node_ip)


def worker_actor(cls: type) -> Any:
    """`cls` as the Ray actor class every worker role is deployed as."""
    return ray.remote(num_cpus=0, max_concurrency=1000)(cls)


def _stat_loggers() -> tuple[type, ...]:
    """Imported here, where an engine starts: routers and the controller import this module
    for the worker actor classes and would otherwise load vLLM and torch for nothing."""
    from vllm_engine.stat_logger import EngineStatLogger

    return (EngineStatLogger,)
