"""What a worker needs from its vLLM engine, and which engine path each device gets.

Two implementations behind one interface:
- `EngineLoop` (vllm_engine.loop): vLLM's LLMEngine in the actor's process, stepped on one
  thread. CPU default: no engine-core process to start (slow on a small CPU host) or to
  spin a core.
- `AsyncEngine` (vllm_engine.async_engine): vLLM's AsyncLLM, the engine core in its own
  process with async scheduling, as vLLM's own server runs it. GPU default: the front end
  (detokenizing, streaming) never stalls the GPU's next step.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Protocol

from messages.reports import EngineLoad
from messages.requests import ModelLimits
from vllm_engine.config import EngineConfig

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput

    from kv_transfer.layout import StateLayout


class Engine(Protocol):
    @property
    def limits(self) -> ModelLimits: ...

    @property
    def prefill_backoff(self) -> int:
        """Prompt tokens a producer leaves for decode to compute (kv_transfer.connector_config)."""
        ...

    async def state_layout(self) -> "StateLayout": ...

    def generate(
        self, request_id: str, prompt: dict[str, Any], params: "SamplingParams"
    ) -> AsyncIterator["RequestOutput"]:
        """This request's outputs; leaving early (break, cancel) aborts it in the engine."""
        ...

    async def release_transfer(self, kv_transfer_params: dict[str, Any]) -> None:
        """Tell the producer named in these params (over NIXL) that its blocks will never be
        read, so it frees them now instead of at lease expiry (decode role only)."""
        ...

    def load(self) -> EngineLoad:
        """Raises EngineDeadError when the engine can no longer serve."""
        ...

    def shutdown(self) -> None: ...


def start_engine(
    config: EngineConfig,
    kv_transfer_config: Any = None,
    env: dict[str, str] | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
    stat_loggers: list[Any] | None = None,
    kv_events_config: Any = None,
) -> Engine:
    """Build the engine on the path its device gets (`EngineConfig.path`); `kv_events_config`:
    where it publishes its KV cache events (vllm_engine.prefix_index)."""
    if config.path == "async":
        from vllm_engine.async_engine import AsyncEngine

        return AsyncEngine.start(config, kv_transfer_config, env, on_fatal, stat_loggers, kv_events_config)
    from vllm_engine.loop import EngineLoop

    return EngineLoop.start(config, kv_transfer_config, env, on_fatal, stat_loggers, kv_events_config)


def exit_for_restart(exc: BaseException) -> None:
    """`on_fatal` for engines inside a supervised process (a Ray actor): die loudly so the
    supervisor restarts a fresh engine, instead of lingering as a zombie that accepts work."""
    print(f"vLLM engine failed, exiting for restart: {exc!r}", file=sys.stderr, flush=True)
    os._exit(70)


def prepare_process(config: EngineConfig, env: dict[str, str] | None) -> None:
    """Environment first (vLLM reads it when the engine is created), then pdserve's vLLM
    plugin for this process; vLLM runs it itself in every process it spawns."""
    os.environ.update({**config.process_env(), **(env or {})})
    from vllm_engine.vllm_plugin import register

    register()
