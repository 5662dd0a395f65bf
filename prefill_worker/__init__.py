"""Prefill role: one vLLM engine as KV producer. Runs prompts, hands out transfer handles."""

from prefill_worker.worker import PrefillResult, PrefillWorker

__all__ = ["PrefillResult", "PrefillWorker"]
