"""Decode role: one vLLM engine as KV consumer, streaming tokens with continuous batching."""

from decode_worker.worker import DecodeWorker, TransferFailedError

__all__ = ["DecodeWorker", "TransferFailedError"]
