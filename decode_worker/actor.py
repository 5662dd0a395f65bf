"""The decode worker as a Ray actor; `generate` is a Ray streaming generator."""

from __future__ import annotations

from decode_worker.worker import DecodeWorker
from vllm_engine.worker_base import InRayActor, worker_actor


@worker_actor
class DecodeActor(InRayActor, DecodeWorker):
    pass
