"""Decode role: one vLLM engine as KV consumer, streaming tokens with continuous batching."""

from decode_worker.worker import DecodeWorker

__all__ = ["DecodeWorker"]
