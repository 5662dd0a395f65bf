"""The prefill worker as a Ray actor: placed by Ray resources, reachable at its node's address."""

from __future__ import annotations

from prefill_worker.worker import PrefillWorker
from vllm_engine.worker_base import InRayActor, worker_actor


@worker_actor
class PrefillActor(InRayActor, PrefillWorker):
    pass
