"""What every worker role offers around its engine loop, whatever it does with requests."""

from __future__ import annotations

import os
from dataclasses import replace

from vllm_engine.loop import EngineLoad, EngineLoop
from vllm_engine.requests import ModelLimits


class EngineWorker:
    engine_id: str  # NIXL identity; a restarted worker gets a new one
    _loop: EngineLoop
    _metrics_address: str = ""

    def ready(self) -> str:
        return self.engine_id

    def load(self) -> EngineLoad:
        """Cheap load report; carries the engine id so a router notices a restart."""
        return replace(self._loop.load(), engine_id=self.engine_id)

    def model_limits(self) -> ModelLimits:
        return self._loop.limits

    def pid(self) -> int:
        """The worker's process (benchmarks read its CPU time; fault tests signal it)."""
        return os.getpid()

    def metrics_address(self) -> str:
        """Where Prometheus scrapes this worker's metrics ("" when not exported)."""
        return self._metrics_address

    def shutdown(self) -> None:
        self._loop.shutdown()
