"""An engine that serves whichever pool the controller puts it in.

Its NixlConnector runs as producer and consumer at once (`Role.EITHER`, vLLM's kv_both), so
it prefills for remote decode (`prefill`, as a prefill worker does) and decodes pulled
state (`start_leg`/`feed`, as a decode worker does). Moving it between the pools is then a
drain and a relabel in the controller, with no engine restart: how a role-switching
deployment changes its split (controller/deployment.py).
"""

from __future__ import annotations

import ray

from decode_worker.worker import DecodeWorker
from kv_transfer.connector_config import Role, TransferConfig, pick_side_channel
from kv_transfer.metrics import serve_metrics
from prefill_worker.worker import PrefillDuty
from vllm_engine.config import EngineConfig
from vllm_engine.engine import exit_for_restart


@ray.remote(num_cpus=0, max_concurrency=1000)
class EitherRoleActor(PrefillDuty, DecodeWorker):
    def __init__(self, name: str, engine_config: EngineConfig, transfer: TransferConfig) -> None:
        node_ip = ray.util.get_node_ip_address()
        channel = pick_side_channel(node_ip)
        super().__init__(
            name, engine_config, transfer, channel, on_fatal=exit_for_restart, role=Role.EITHER, feed_host=node_ip
        )
        self._metrics_address = serve_metrics(node_ip)
