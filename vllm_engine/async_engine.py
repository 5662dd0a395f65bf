"""vLLM's AsyncLLM behind the worker's engine interface: the production path on GPUs.

The engine core runs in its own process (vLLM's `EngineCoreProc`, busy loop with async
scheduling), so the actor's event loop only detokenizes and streams while the GPU steps.
TP ranks are worker processes of that core. Everything vLLM's own OpenAI server relies on
is used as is; pdserve adds only two small readers:
- load reports from the scheduler statistics vLLM hands its stat loggers each step;
- the KV-cache layout, read on the ranks (vllm_engine.worker_extension), since the
  scheduler's copy lives in the engine-core process.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from messages.errors import EngineDeadError
from messages.reports import EngineLoad
from messages.requests import ModelLimits
from vllm_engine.config import EngineConfig
from vllm_engine.engine import EngineWiring, engine_args, model_limits, prepare_process
from vllm_engine.sampling import as_invalid_request

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    from kv_transfer.layout import StateLayout


class _LatestSchedulerStats:
    """A stat logger (vLLM calls `record` with each engine step's scheduler statistics)."""

    def __init__(self) -> None:
        self.latest: Any = None

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> "_LatestSchedulerStats":
        return self  # vLLM builds loggers from factories; this one is its own

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        if scheduler_stats is not None:
            self.latest = scheduler_stats

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass


class AsyncEngine:
    def __init__(
        self, llm: "AsyncLLM", stats: _LatestSchedulerStats, on_fatal: Callable[[BaseException], None] | None
    ) -> None:
        self._llm = llm
        self._stats = stats
        self._on_fatal = on_fatal
        self._layout: StateLayout | None = None
        # vLLM's pool size as the engine core reported it at start-up (one null block).
        self._total_blocks = (llm.vllm_config.cache_config.num_gpu_blocks or 1) - 1

    @classmethod
    def start(cls, config: EngineConfig, wiring: EngineWiring) -> "AsyncEngine":
        prepare_process(config, wiring.env)
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(config, wiring)
        stats = _LatestSchedulerStats()
        llm = AsyncLLM.from_vllm_config(args.create_engine_config(), stat_loggers=[stats, *wiring.stat_loggers])
        return cls(llm, stats, wiring.on_fatal)

    @property
    def limits(self) -> ModelLimits:
        return model_limits(self._llm.vllm_config)

    @property
    def prefill_backoff(self) -> int:
        from kv_transfer.connector_config import prefill_backoff

        return prefill_backoff(self._llm.vllm_config)

    async def state_layout(self) -> "StateLayout":
        from kv_transfer.layout import StateLayout

        if self._layout is None:
            ranks = await self._llm.collective_rpc("pdserve_state_layout")
            layout = StateLayout.from_dict(ranks[0])
            self._layout = StateLayout(layout.groups, layout.num_blocks, len(ranks))
        return self._layout

    async def on_every_rank(self, method: str, *args: Any) -> list[Any]:
        return await self._llm.collective_rpc(method, args=args)

    async def generate(
        self, request_id: str, prompt: dict[str, Any], params: "SamplingParams"
    ) -> AsyncIterator["RequestOutput"]:
        """`prompt`: a TokensPrompt (vllm_engine.sampling.engine_prompt)."""
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        try:
            async for output in self._llm.generate(prompt, params, request_id):
                yield output
        except VllmEngineDeadError as exc:
            if self._on_fatal is not None:
                self._on_fatal(exc)
            raise
        except VLLMValidationError as exc:
            raise as_invalid_request(exc) from None

    async def release_transfer(self, kv_transfer_params: dict[str, Any]) -> None:
        await self._llm.notify_kv_transfer_request_rejected(f"release-{uuid.uuid4().hex}", kv_transfer_params)

    def load(self) -> EngineLoad:
        if self._llm.errored:
            raise EngineDeadError(f"vLLM's engine core died: {self._llm.dead_error!r}")
        stats = self._stats.latest
        if stats is None:
            return EngineLoad(0, 0, 0, self._total_blocks, self._total_blocks)
        used = round(stats.kv_cache_usage * self._total_blocks)
        running, waiting = stats.num_running_reqs, stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        return EngineLoad(
            running=running,
            waiting=waiting,
            # vLLM's statistics do not count requests held for a peer's read; blocks in use
            # with nothing running or waiting mean at least one.
            held_for_transfer=int(used > 0 and not running and not waiting),
            free_blocks=self._total_blocks - used,
            total_blocks=self._total_blocks,
        )

    def shutdown(self) -> None:
        self._llm.shutdown()
