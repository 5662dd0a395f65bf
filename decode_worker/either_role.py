"""An engine that serves whichever pool the controller puts it in.

Its NixlConnector runs as producer and consumer at once (`Role.EITHER`, vLLM's kv_both), so
it prefills for remote decode (`prefill`, as a prefill worker does) and decodes pulled
state (`start_leg`/`feed`, as a decode worker does). Moving it between the pools is then a
drain and a relabel in the controller, with no engine restart: how a role-switching
deployment changes its split (controller/deployment.py).
"""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from kv_transfer.connector_config import Role
from prefill_worker.worker import PrefillWorker
from vllm_engine.worker_base import InRayActor, worker_actor


@worker_actor
class EitherRoleActor(InRayActor, PrefillWorker, DecodeWorker):
    connector_role = Role.EITHER
