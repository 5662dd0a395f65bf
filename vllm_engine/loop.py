"""Drive one in-process vLLM engine from asyncio, with continuous batching.

vLLM's AsyncLLM always runs the engine core in a second process; on a small CPU host that
process lengthens start-up and spin-waits a whole core. `LLMEngine` with
VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the core in-process, but is synchronous. This class
owns such an engine on one thread: it takes new requests and aborts between steps, runs
`step()` while anything is scheduled (every step advances every running request: that is
the continuous batching), and hands each request's outputs to the asyncio loop that asked.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from messages.errors import EngineDeadError
from messages.reports import EngineLoad
from messages.requests import ModelLimits
from vllm_engine.config import EngineConfig, cores_of
from vllm_engine.cpu_affinity import confine_python_threads, parse_cores
from vllm_engine.engine import EngineWiring, engine_args, model_limits, prepare_process
from vllm_engine.metrics import ENGINE_STEP_CPU
from vllm_engine.sampling import as_invalid_request

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

    from kv_transfer.layout import StateLayout

# How often a loop with nothing to compute still steps while a KV connector holds finished
# requests' blocks (a producer waiting for decode's read, or for a lease to run out). Such a
# step only frees blocks and a command wakes the loop at once, so it need not be frequent:
# empty steps are not free (docs/benchmarks.md, "Idle engines spent a sixth of it").
_HELD_POLL_S = 0.05
_IDLE_WAIT_S = 1.0  # nothing held: only a command, which wakes the loop, brings work


@dataclass(frozen=True, slots=True)
class _Sink:
    """Where one request's outputs go: a queue read on an asyncio loop in another thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any]

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: dict[str, Any]  # a TokensPrompt
    params: "SamplingParams"
    sink: _Sink


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Release:
    kv_transfer_params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Call:
    """A method of every rank (vllm_engine.worker_extension), run between steps."""

    method: str
    args: tuple[Any, ...]
    sink: _Sink


class EngineLoop:
    def __init__(self, engine: "LLMEngine", on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self._engine = engine
        # An exception out of step() leaves the engine in an unknown state: callers are
        # told, then `on_fatal` decides (a Ray actor exits so Ray restarts it).
        self._on_fatal = on_fatal
        self._scheduler = engine.engine_core.engine_core.scheduler
        self._commands: queue.SimpleQueue[_Add | _Abort | _Release | _Call | None] = queue.SimpleQueue()
        self._step_once = False  # a release must reach the connector even with nothing to run
        self._sinks: dict[str, _Sink] = {}
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, config: EngineConfig, wiring: EngineWiring) -> "EngineLoop":
        """Build the engine in this process (TP ranks, if any, are processes vLLM spawns)."""
        prepare_process(config, wiring.env)
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(
            engine_args(config, wiring),
            stat_loggers=list(wiring.stat_loggers),
        )
        if config.cpu_cores is not None and config.device == "cpu":
            # The loop thread starts from here: Python threads share the engine's cores (with
            # TP > 1 this process only schedules; the ranks run the forward on their own).
            confine_python_threads(parse_cores(cores_of(config.cpu_cores)))
        return cls(engine, wiring.on_fatal)

    @property
    def limits(self) -> ModelLimits:
        return model_limits(self._engine.vllm_config)

    @property
    def prefill_backoff(self) -> int:
        from kv_transfer.connector_config import prefill_backoff

        return prefill_backoff(self._engine.vllm_config)

    async def state_layout(self) -> "StateLayout":
        from kv_transfer.layout import StateLayout

        tp = self._engine.vllm_config.parallel_config.tensor_parallel_size
        return StateLayout.from_kv_cache_config(self._scheduler.kv_cache_config, tp, self._engine.vllm_config)

    async def generate(
        self, request_id: str, prompt: dict[str, Any], params: "SamplingParams"
    ) -> AsyncIterator["RequestOutput"]:
        """Yield this request's outputs (`prompt`: a TokensPrompt, vllm_engine.sampling.engine_prompt);
        leaving early (break, cancel) aborts it in the engine."""
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._send(_Add(request_id, prompt, params, _Sink(asyncio.get_running_loop(), outputs)))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def release_transfer(self, kv_transfer_params: dict[str, Any]) -> None:
        self._send(_Release(dict(kv_transfer_params)))

    def load(self) -> EngineLoad:
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop thread has exited")
        # Read from another thread without locking: counters only, a stale value is fine.
        running, waiting = self._scheduler.get_request_counts()
        pool = self._scheduler.kv_cache_manager.block_pool
        return EngineLoad(
            running=running,
            waiting=waiting,
            held_for_transfer=max(0, len(self._scheduler.requests) - running - waiting),
            free_blocks=pool.get_num_free_blocks(),
            total_blocks=pool.num_gpu_blocks - 1,  # block 0 is vLLM's reserved null block
        )

    def shutdown(self) -> None:
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout=10)
        # A TP engine's rank processes and the shared-memory queues to them outlive a kill of
        # this process; a one-process engine's resources go with it (its shutdown, ~1 s, is
        # skipped). A loop stuck in a step is left to the caller's kill.
        if self._engine.vllm_config.parallel_config.world_size > 1 and not self._thread.is_alive():
            self._engine.engine_core.shutdown()

    async def on_every_rank(self, method: str, *args: Any) -> list[Any]:
        answer: asyncio.Queue[Any] = asyncio.Queue()
        self._send(_Call(method, args, _Sink(asyncio.get_running_loop(), answer)))
        result = await answer.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def _send(self, command: _Add | _Abort | _Release | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while True:
            if not self._apply_commands():
                return
            if self._scheduler.has_unfinished_requests() or self._step_once:
                self._step_once = False
                self._step()
            elif self._scheduler.has_requests():
                self._step()  # lets the connector free blocks once a peer has read them
                self._wake.wait(_HELD_POLL_S)
            else:
                self._wake.wait(_IDLE_WAIT_S)
            self._wake.clear()

    def _apply_commands(self) -> bool:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Abort):
                if self._sinks.pop(command.request_id, None) is not None:
                    self._engine.abort_request([command.request_id])
                continue
            if isinstance(command, _Release):
                self._engine.engine_core.add_request(_pre_aborted(command.kv_transfer_params))
                self._step_once = True
                continue
            if isinstance(command, _Call):
                try:
                    command.sink.put(self._engine.collective_rpc(command.method, args=command.args))
                except Exception as exc:  # the caller's to handle; the engine is fine
                    command.sink.put(exc)
                continue
            try:
                self._engine.add_request(command.request_id, command.prompt, command.params)
            except Exception as exc:  # invalid request: report it to its caller only
                command.sink.put(as_invalid_request(exc))
            else:
                self._sinks[command.request_id] = command.sink

    def _step(self) -> None:
        started = time.thread_time()
        try:
            outputs = self._engine.step()
        except Exception as exc:  # engine failure: every waiting caller must hear of it
            for sink in self._sinks.values():
                sink.put(exc)
            self._sinks.clear()
            if self._on_fatal is not None:
                self._on_fatal(exc)
            raise
        ENGINE_STEP_CPU.inc(time.thread_time() - started)
        # One wake-up per asyncio loop per step, not one per request: the callers of one
        # step's outputs then all run in the same loop iteration (and the self-pipe write,
        # a syscall, is paid once per step).
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._sinks[output.request_id]
            by_loop.setdefault(sink.loop, []).append((sink.queue, output))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_deliver, deliveries)


def _deliver(deliveries: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue_, output in deliveries:
        queue_.put_nowait(output)


def _pre_aborted(kv_transfer_params: dict[str, Any]) -> Any:
    """A request aborted on arrival that carries a producer's transfer params: the consumer's
    NixlConnector then notifies the producer to free the blocks (vLLM's own mechanism; this
    mirrors AsyncLLM.notify_kv_transfer_request_rejected, which LLMEngine lacks)."""
    import uuid

    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=f"release-{uuid.uuid4().hex}",
        prompt_token_ids=[0],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv_transfer_params}),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        abort_immediately=True,
    )
