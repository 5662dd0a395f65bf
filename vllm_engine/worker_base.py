"""What every worker role offers around its engine, whatever it does with requests."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Callable

from kv_transfer.layout import StateLayout
from messages.reports import EngineCapacity, EngineLoad
from messages.requests import ModelLimits
from vllm_engine.config import EngineConfig
from vllm_engine.engine import Engine, start_engine


class EngineWorker:
    engine_id: str  # NIXL identity; a restarted worker gets a new one
    _engine: Engine
    _config: EngineConfig
    _metrics_address: str = ""

    def _start_engine(
        self,
        config: EngineConfig,
        kv_transfer_config: Any = None,
        env: dict[str, str] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        stat_loggers: list[Any] | None = None,
    ) -> None:
        self._config = config
        self._engine = start_engine(config, kv_transfer_config, env, on_fatal, stat_loggers)
        self.limits: ModelLimits = self._engine.limits

    def ready(self) -> str:
        return self.engine_id

    def load(self) -> EngineLoad:
        """Cheap load report; carries the engine id so a router notices a restart, and when it
        was measured so a router can add only its requests started since."""
        return replace(
            self._engine.load(), engine_id=self.engine_id, metrics_address=self._metrics_address, measured_at=time.time()
        )

    def model_limits(self) -> ModelLimits:
        return self.limits

    async def state_layout(self) -> StateLayout:
        return await self._engine.state_layout()

    async def capacity(self) -> EngineCapacity:
        """KV blocks, DeltaNet state slots and max-length requests this engine holds."""
        layout = await self._engine.state_layout()
        return layout.capacity(self.limits.max_model_len, self._config.max_num_seqs)

    def engine_path(self) -> str:
        return self._config.path

    def pid(self) -> int:
        """The worker's process (benchmarks read its CPU time; fault tests signal it)."""
        return os.getpid()

    def metrics_address(self) -> str:
        """Where Prometheus scrapes this worker's metrics ("" when not exported)."""
        return self._metrics_address

    def shutdown(self) -> None:
        self._engine.shutdown()
