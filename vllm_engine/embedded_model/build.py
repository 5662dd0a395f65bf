"""Build the tiny Qwen3.5 hybrid and its byte-level BPE tokenizer, deterministically.

No model hub is reachable, so the default model is made here: a tokenizer and weights both
trained on the text shipped in `corpus/` (see `train.py`: the model learns to reproduce that
text, nothing more). The output directory is an ordinary Hugging Face model directory, so
every other code path treats it exactly like a real checkpoint (e.g. Qwen3.5-27B on a GPU
cluster).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from vllm_engine.embedded_model.texts import EOS_ID, EOS_TOKEN, corpus_bytes, prose_documents, token_stream
from vllm_engine.embedded_model.train import TrainingRecipe, train

# Bumped whenever the build recipe changes so stale cache entries are never reused.
RECIPE_VERSION = 4
# Plain-text roles, so /v1/chat/completions works on the embedded model (real models ship theirs),
# and the offered tools' names first: corpus/transcript-tool-call.txt is this template's output
# for one request plus the Hermes-style call the model learns to answer it with.
CHAT_TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True, slots=True)
class EmbeddedModelSpec:
    """Shape of the tiny hybrid. 3 Gated DeltaNet layers per full-attention layer."""

    hidden_size: int = 256
    intermediate_size: int = 512
    num_layer_groups: int = 2  # each group: 3 linear_attention + 1 full_attention
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    # vLLM's CPU Gated-DeltaNet kernel accepts head dims of 64 or 128 only.
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    vocab_size: int = 2048
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02  # HF's default: the starting point training moves from
    seed: int = 1234  # initial weights and the order training reads the corpus in
    training: TrainingRecipe = field(default_factory=TrainingRecipe)

    def fingerprint(self) -> str:
        blob = json.dumps({"spec": dataclasses.asdict(self), "recipe": RECIPE_VERSION}, sort_keys=True).encode()
        return hashlib.sha256(blob + corpus_bytes()).hexdigest()[:16]


def default_cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "models"


def ensure_embedded_model(spec: EmbeddedModelSpec = EmbeddedModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return the model directory for `spec`, building it first if it is missing.

    Safe to call from many processes at once: a file lock serialises the build and the
    directory appears atomically (built under a temporary name, then renamed).
    """
    target = (cache_dir or default_cache_dir()) / f"tiny-qwen3_5-{spec.fingerprint()}"
    return build_once(target, lambda staging: (_build_tokenizer(spec, staging), _build_model(spec, staging)))


def build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """`target`, made by `build(staging directory)` first if it is missing. Safe from many
    processes at once: a file lock serialises the builds and the directory appears whole
    (built under a temporary name, then renamed)."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        staging = target.parent / f".{target.name}.staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        build(staging)
        staging.rename(target)
    return target


def _build_tokenizer(spec: EmbeddedModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Single-threaded training keeps merges identical from run to run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(prose_documents(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN)
    fast.model_max_length = spec.max_position_embeddings
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _build_model(spec: EmbeddedModelSpec, out: Path) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    config = Qwen3_5TextConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=4 * spec.num_layer_groups,
        layer_types=layer_types * spec.num_layer_groups,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        linear_key_head_dim=spec.linear_key_head_dim,
        linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads,
        linear_num_value_heads=spec.linear_num_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        bos_token_id=None,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(config).float()  # fp32 master weights while training
    train(model, token_stream(out), spec.training, spec.seed)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
