"""The embedded model with a trained multi-token-prediction (MTP) head, as Qwen3.5 ships one.

Qwen3.5 checkpoints carry `mtp.*` weights: one extra full-attention decoder layer that
reads the model's last hidden state at position t and the embedding of token t+1, and
predicts token t+2 through the shared LM head. vLLM runs it as a speculative-decoding draft
(`speculative_config={"method": "mtp"}`, vllm/model_executor/models/qwen3_5_mtp.py), and the
draft layer keeps KV of its own, which a P/D handoff must move too.

Hugging Face's Qwen3.5 classes drop those weights, so the head is built from their decoder
layer and trained here, with the embedded model frozen, on the same corpus: a draft that is
right most of the time, so acceptance is a measurement, not noise.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_engine.embedded_model.build import build_once, default_cache_dir, ensure_embedded_model
from vllm_engine.embedded_model.texts import token_stream

if TYPE_CHECKING:
    import torch

RECIPE_VERSION = 2


@dataclass(frozen=True, slots=True)
class MtpRecipe:
    steps: int = 60
    batch_size: int = 8
    seq_len: int = 256
    learning_rate: float = 3e-3
    seed: int = 4321
    threads: int = 2  # fixed: the reduction order, and so the bits, depend on it


def ensure_mtp_model(recipe: MtpRecipe = MtpRecipe(), cache_dir: Path | None = None) -> Path:
    """The embedded model's directory plus `mtp.*` weights and `mtp_num_hidden_layers: 1`,
    built first if missing (file-locked and renamed into place whole)."""
    base = ensure_embedded_model(cache_dir=cache_dir)
    target = (cache_dir or default_cache_dir()) / f"{base.name}-mtp{RECIPE_VERSION}-{recipe.steps}"
    return build_once(target, lambda staging: _build(base, recipe, staging))


def _build(base: Path, recipe: MtpRecipe, out: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM

    for item in base.iterdir():
        shutil.copy2(item, out / item.name)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        model = Qwen3_5ForCausalLM.from_pretrained(base, dtype=torch.float32)
        head = _train(model, token_stream(out), recipe)
    finally:
        torch.set_num_threads(threads)
    weights = load_file(out / "model.safetensors")
    weights.update({f"mtp.{name}": w.detach().to(torch.bfloat16).contiguous() for name, w in head.state_dict().items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _head(config: object) -> "torch.nn.Module":
    """vLLM's Qwen3_5MultiTokenPredictor, by its weight names."""
    from torch import nn
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    hidden, eps = config.hidden_size, config.rms_norm_eps
    attention = config.layer_types.index("full_attention")  # the layer index only picks its type
    head = nn.Module()
    head.fc = nn.Linear(2 * hidden, hidden, bias=False)
    head.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
    head.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
    head.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, layer_idx=attention)])
    head.norm = Qwen3_5RMSNorm(hidden, eps)
    return head


def draft_logits(
    model: object, head: "torch.nn.Module", embedded: "torch.Tensor", hidden: "torch.Tensor"
) -> "torch.Tensor":
    """The head's logits for tokens 2.. of a window (batch, length), as vLLM computes a draft:
    fc(embedding of token t+1 ++ the model's final hidden state at t), one causal decoder
    layer, norm, the model's LM head. `embedded`, `hidden`: the window's token embeddings and
    final hidden states."""
    import torch

    x = head.fc(torch.cat([head.pre_fc_norm_embedding(embedded[:, 1:]), head.pre_fc_norm_hidden(hidden[:, :-1])], -1))
    length = x.shape[1]
    positions = torch.arange(length).view(1, 1, -1).expand(3, x.shape[0], -1)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    x = head.layers[0](x, position_embeddings=model.model.rotary_emb(x, positions), attention_mask=causal)
    return model.lm_head(head.norm(x))


def _train(model: object, stream: list[int], recipe: MtpRecipe) -> "torch.nn.Module":
    import sys

    import torch

    torch.manual_seed(recipe.seed)
    head = _head(model.config).float()
    model.requires_grad_(False)
    model.eval()
    generator = torch.Generator().manual_seed(recipe.seed)
    ring = torch.tensor(stream + stream[: recipe.seq_len], dtype=torch.long)
    # The frozen model reads the corpus once, as one sequence: every window then sees hidden
    # states with the context an engine's would have, and a step costs only the head.
    with torch.no_grad():
        all_hidden = model.model(input_ids=ring[None], use_cache=False).last_hidden_state[0]
        all_embedded = model.model.embed_tokens(ring)
    optimizer = torch.optim.AdamW(head.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    started = time.monotonic()
    print(f"training an MTP head for the embedded model: {recipe.steps} steps", file=sys.stderr, flush=True)
    for step in range(1, recipe.steps + 1):
        starts = torch.randint(0, len(stream), (recipe.batch_size,), generator=generator).tolist()
        batch = torch.stack([ring[s : s + recipe.seq_len] for s in starts])
        embedded = torch.stack([all_embedded[s : s + recipe.seq_len] for s in starts])
        hidden = torch.stack([all_hidden[s : s + recipe.seq_len] for s in starts])
        logits = draft_logits(model, head, embedded, hidden)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 2:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == recipe.steps:
            right = (logits.argmax(-1) == batch[:, 2:]).float().mean().item()  # the draft's hit rate
            elapsed = time.monotonic() - started
            print(
                f"  step {step:>4}/{recipe.steps}  loss {loss.item():.3f}  drafts right {right:.0%}  {elapsed:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return head
