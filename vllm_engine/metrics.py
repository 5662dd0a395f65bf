"""Prometheus metrics of the engine itself, exported with the worker's (kv_transfer.metrics)."""

from __future__ import annotations

from prometheus_client import Counter

# CPU time of the thread that runs the engine's steps (scheduling, forward, output
# processing). Beside the process's CPU it shows what serving costs outside the engine.
# Only the in-process engine path counts it: AsyncLLM steps in a process of its own.
ENGINE_STEP_CPU = Counter("pdserve_engine_step_cpu_seconds_total", "CPU seconds spent in engine steps")
