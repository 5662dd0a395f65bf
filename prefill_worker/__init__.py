"""Prefill role: one vLLM engine as KV producer. Runs prompts, hands out transfer handles."""

from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker"]
