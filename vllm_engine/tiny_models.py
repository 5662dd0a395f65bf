"""Tiny random-weight models of the architectures users serve beside the embedded hybrid.

One per KV-cache shape vLLM gives a model: attention only (dense GQA), Gated DeltaNet with
MoE MLPs, Mamba-2 layers (NemotronH), sliding-window attention (Gemma 3) and sliding
windows with MoE and attention sinks (gpt-oss). Random weights are enough: equivalence is
checked by teacher-forced logprobs (vllm_engine.teacher_forcing), not by what the model
says. Each is an ordinary Hugging Face directory with the embedded model's tokenizer,
built deterministically on first use and cached beside the embedded model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_engine.embedded_model import ensure_embedded_model
from vllm_engine.embedded_model.build import build_once, default_cache_dir
from vllm_engine.embedded_model.texts import EOS_ID

# Bumped whenever a recipe changes so stale cache entries are never reused.
RECIPE_VERSION = 1
# Shared by every architecture (the embedded tokenizer's vocabulary; vLLM's CPU attention
# and GDN kernels take head dims of 64). A wider init than Hugging Face's 0.02 gives logits
# far from uniform, so a wrong state moves the logprobs well past bf16 noise.
_COMMON: dict[str, Any] = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    eos_token_id=EOS_ID,
    bos_token_id=None,
    pad_token_id=None,
    initializer_range=0.1,
)
_GDN = dict(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4)
SLIDING_WINDOW = 128  # tokens: one CPU block, so a few-block prompt already leaves blocks out


@dataclass(frozen=True, slots=True)
class TinyModel:
    """`config` and `model`: transformers class names; `settings`: the config's fields."""

    name: str
    kind: str  # what the architecture adds, for tables and test ids
    config: str
    model: str
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def fingerprint(self) -> str:
        blob = json.dumps(
            {"model": self.model, "settings": {**_COMMON, **self.settings}, "seed": self.seed, "v": RECIPE_VERSION},
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TINY_MODELS = {
    m.name: m
    for m in (
        TinyModel("qwen3", "dense GQA", "Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=4)),
        TinyModel(
            "qwen3_5_moe",
            "MoE Gated DeltaNet hybrid",
            "Qwen3_5MoeTextConfig",
            "Qwen3_5MoeForCausalLM",
            dict(
                num_hidden_layers=4,
                layer_types=["linear_attention"] * 3 + ["full_attention"],
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=128,
                shared_expert_intermediate_size=128,
                **_GDN,
            ),
        ),
        TinyModel(
            "nemotron_h",
            "Mamba-2 hybrid",
            "NemotronHConfig",
            "NemotronHForCausalLM",
            # Mamba, MLP, Mamba, attention.
            dict(
                num_hidden_layers=4,
                hybrid_override_pattern="M-M*",
                mamba_num_heads=8,
                mamba_head_dim=64,
                ssm_state_size=64,
                n_groups=2,
                chunk_size=128,
            ),
        ),
        TinyModel(
            "gemma3",
            "sliding window",
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            dict(
                num_hidden_layers=4,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
                sliding_window=SLIDING_WINDOW,
                query_pre_attn_scalar=64,
            ),
        ),
        TinyModel(
            "gpt_oss",
            "sliding window, MoE, attention sinks",
            "GptOssConfig",
            "GptOssForCausalLM",
            dict(
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=SLIDING_WINDOW,
                num_local_experts=4,
                num_experts_per_tok=2,
            ),
        ),
    )
}


def ensure_tiny_model(name: str, cache_dir: Path | None = None) -> Path:
    """The model directory of TINY_MODELS[name], built first if missing (file-locked, and
    renamed into place whole, as the embedded model is)."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}: choose one of {', '.join(TINY_MODELS)}")
    spec = TINY_MODELS[name]
    cache_dir = cache_dir or default_cache_dir()
    tokenizer = ensure_embedded_model(cache_dir=cache_dir)

    def build(staging: Path) -> None:
        _build(spec, staging)
        for item in tokenizer.iterdir():
            if item.name.startswith("tokenizer") or item.name == "chat_template.jinja":
                shutil.copy(item, staging / item.name)

    return build_once(cache_dir / f"tiny-{name}-{spec.fingerprint()}", build)


def _build(spec: TinyModel, out: Path) -> None:
    import torch
    import transformers

    config = getattr(transformers, spec.config)(**{**_COMMON, **spec.settings}, torch_dtype="bfloat16")
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.model)(config)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
