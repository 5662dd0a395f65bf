"""Engine configuration shared by the prefill and decode roles (and the colocated baseline).

Both roles must build their engine from the same `EngineConfig`: NIXL's handshake checks a
compatibility hash over model, dtype, block size and cache layout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.engine.arg_utils import EngineArgs

# Required by NixlConnector for Mamba/Gated-DeltaNet state: conv state stored (dim, state)
# so its sub-projections are contiguous and can be read with a few descriptors.
HYBRID_TRANSFER_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}


EMBEDDED_MODEL = "embedded"


def resolve_model(model: str) -> str:
    """A model directory path; "embedded" builds the tiny default hybrid on this node."""
    if model != EMBEDDED_MODEL:
        return model
    from vllm_engine.embedded_model import ensure_embedded_model

    return str(ensure_embedded_model())


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # A Hugging Face model directory, or "embedded" (resolved on each node, so a cluster's
    # nodes need no shared filesystem for the default model).
    model: str = EMBEDDED_MODEL
    dtype: str = "bfloat16"
    max_model_len: int = 8192
    # Explicit KV cache size: vLLM's CPU default tries to reserve ~92% of RAM.
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = True
    seed: int = 0
    # CPU only: cores this engine's OpenMP threads bind to, e.g. "0" or "2-3". On GPUs
    # the device is chosen by Ray/CUDA_VISIBLE_DEVICES and this is ignored.
    cpu_cores: str | None = None
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

    def with_cores(self, cpu_cores: str | None) -> "EngineConfig":
        return replace(self, cpu_cores=cpu_cores)

    def process_env(self) -> dict[str, str]:
        """Environment this engine's process needs before vLLM is imported."""
        env = {
            # One engine per process, in that process: no extra engine-core process.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            **HYBRID_TRANSFER_ENV,
        }
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        return env

    def engine_args(self, kv_transfer_config: Any = None) -> "EngineArgs":
        from vllm.engine.arg_utils import EngineArgs

        model = resolve_model(self.model)
        return EngineArgs(
            model=model,
            tokenizer=model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            # Prefix caching on hybrids needs 'align' mamba caching, ~6x slower on CPU.
            enable_prefix_caching=False,
            kv_transfer_config=kv_transfer_config,
            **self.extra_engine_args,
        )


def apply_process_env(env: dict[str, str]) -> None:
    """Set env for this process; must run before vLLM reads its environment variables."""
    os.environ.update(env)
