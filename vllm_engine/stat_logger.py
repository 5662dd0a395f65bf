"""The stat logger vLLM calls each engine step: its stats as pdserve's metrics.

Apart from vllm_engine.metrics because it subclasses vLLM's: routers and the controller
import the worker modules (Ray loads an actor's class to use its handle) and need no vLLM.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from kv_transfer.metrics import observe_connector_stats
from vllm_engine.metrics import PROMPT_TOKENS


class EngineStatLogger(StatLoggerBase):
    """What vLLM hands its stat loggers each step, as our metrics: the prompt-token breakdown,
    and the KV connector's transfer statistics where the engine has a connector."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        connector = getattr(scheduler_stats, "kv_connector_stats", None)
        if connector:
            observe_connector_stats(connector)
        stats = getattr(iteration_stats, "prompt_token_stats", None)
        if stats is None:
            return
        for source, count in (
            ("computed", stats.computed),
            ("local_cache_hit", stats.local_cache_hit),
            ("pulled", stats.external_kv_transfer),
        ):
            if count:
                PROMPT_TOKENS.labels(source).inc(count)

    def log_engine_initialized(self) -> None:
        pass
