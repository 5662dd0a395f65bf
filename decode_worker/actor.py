"""The decode worker as a Ray actor; `generate` is a Ray streaming generator."""

from __future__ import annotations

import ray

from decode_worker.worker import DecodeWorker
from kv_transfer.connector_config import TransferConfig, pick_side_channel
from kv_transfer.metrics import serve_metrics
from vllm_engine.config import EngineConfig
from vllm_engine.engine import exit_for_restart


@ray.remote(num_cpus=0, max_concurrency=1000)
class DecodeActor(DecodeWorker):
    def __init__(self, name: str, engine_config: EngineConfig, transfer: TransferConfig | None) -> None:
        node_ip = ray.util.get_node_ip_address()
        channel = pick_side_channel(node_ip) if transfer else None
        super().__init__(name, engine_config, transfer, channel, on_fatal=exit_for_restart, feed_host=node_ip)
        self._metrics_address = serve_metrics(node_ip)
