"""Prometheus metrics of the engine itself, exported with the worker's (kv_transfer.metrics);
vllm_engine.stat_logger fills them from vLLM's stats."""

from __future__ import annotations


from prometheus_client import Counter, Gauge, Histogram

# CPU time of the thread that runs the engine's steps (scheduling, forward, output
# processing). Beside the process's CPU it shows what serving costs outside the engine.
# Only the in-process engine path counts it: AsyncLLM steps in a process of its own.
ENGINE_STEP_CPU = Counter("pdserve_engine_step_cpu_seconds_total", "CPU seconds spent in engine steps")

# A pool's prefix-cache hit rate is local_cache_hit over the sum (PromQL by pool's targets).
PROMPT_TOKENS = Counter(
    "pdserve_prompt_tokens_total",
    "Prompt tokens by where the engine got them: computed, its prefix cache, or pulled from a producer",
    ["source"],
)


PREFIX_INDEX_BLOCKS = Gauge(
    "pdserve_prefix_index_blocks", "Block hashes in the engine's prefix index, every KV-cache group counted"
)
KV_EVENT_LAG = Histogram(
    "pdserve_kv_event_lag_seconds",
    "From vLLM stamping a batch of KV cache events to the prefix index applying it",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
PREFIX_INDEX_RESYNCS = Counter(
    "pdserve_prefix_index_resyncs_total", "Event gaps the replay could not fill: the index restarted empty"
)
