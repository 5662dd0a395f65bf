"""Train the embedded model on the shipped corpus until it reproduces it.

The goal is a model whose greedy output is decisive (clear top-1 margins, so bf16 rounding
differences between engines cannot flip a token) and readable (it continues a corpus sentence
with the corpus). Nothing else: a few thousand tokens of text teach memorisation, not language.

Deterministic on a given machine and torch build: fixed seed, fixed thread count, the data
order drawn from a seeded generator. Plain PyTorch on CPU through Hugging Face's
`Qwen3_5ForCausalLM`, whose reference Gated DeltaNet (chunked, in torch) is differentiable.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TextIO

if TYPE_CHECKING:
    import torch
    from transformers import Qwen3_5ForCausalLM

LOG_EVERY = 10  # steps between progress lines


@dataclass(frozen=True, slots=True)
class TrainingRecipe:
    """How the weights are learned. Part of the model's fingerprint."""

    steps: int = 100  # enough to reproduce the corpus (the build's summary line says how well)
    batch_size: int = 8
    seq_len: int = 256  # one attention block: every window spans sentences and paragraphs
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    final_lr_fraction: float = 0.1  # cosine decay ends at this fraction of the peak
    # Fixed, not "all cores": the reduction order (and so the bits) depends on it.
    threads: int = 2


@dataclass(frozen=True, slots=True)
class TrainingReport:
    steps: int
    tokens: int  # corpus tokens, documents joined by EOS
    first_loss: float
    final_loss: float
    accuracy: float  # greedy next-token accuracy over the corpus after training
    wall_s: float

    def summary(self) -> str:
        return (
            f"trained {self.steps} steps on {self.tokens:,} corpus tokens in {self.wall_s:.0f} s: "
            f"loss {self.first_loss:.2f} -> {self.final_loss:.3f}, next-token accuracy {self.accuracy:.1%}"
        )


def train(
    model: Qwen3_5ForCausalLM,
    stream: list[int],
    recipe: TrainingRecipe,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> TrainingReport:
    """Fit `model` (fp32, in place) to `stream`, a token sequence read as a ring.

    Windows start anywhere on the ring so every token is a target equally often and is seen
    after both short and long contexts (prompts start mid-sentence).
    """
    import torch

    log = log or _stderr
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        return _train(model, stream, recipe, seed, log)
    finally:
        torch.set_num_threads(threads)


def _train(
    model: Qwen3_5ForCausalLM, stream: list[int], recipe: TrainingRecipe, seed: int, log: Callable[[str], None]
) -> TrainingReport:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ring = torch.tensor(stream + stream[: recipe.seq_len], dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, recipe))
    model.train()
    started = time.monotonic()
    first_loss = final_loss = math.nan
    log(f"training the embedded model: {recipe.steps} steps of {recipe.batch_size} x {recipe.seq_len} tokens")
    for step in range(1, recipe.steps + 1):
        starts = torch.randint(0, len(stream), (recipe.batch_size,), generator=generator)
        batch = torch.stack([ring[s : s + recipe.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        final_loss = loss.item()
        if step == 1:
            first_loss = final_loss
        if step % LOG_EVERY == 0 or step == recipe.steps:
            elapsed = time.monotonic() - started
            log(f"  step {step:>4}/{recipe.steps}  loss {final_loss:.3f}  {elapsed:.0f} s")
    accuracy = _accuracy(model, ring, len(stream), recipe.seq_len)
    report = TrainingReport(recipe.steps, len(stream), first_loss, final_loss, accuracy, time.monotonic() - started)
    log(report.summary())
    return report


def _lr_factor(step: int, recipe: TrainingRecipe) -> float:
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return recipe.final_lr_fraction + (1 - recipe.final_lr_fraction) * cosine


def _accuracy(model: Qwen3_5ForCausalLM, ring: torch.Tensor, length: int, seq_len: int) -> float:
    """Share of corpus tokens that greedy prediction gets right, in consecutive windows."""
    import torch

    model.eval()
    right = total = 0
    with torch.no_grad():
        for start in range(0, length, seq_len):
            window = ring[start : start + seq_len + 1].unsqueeze(0)
            predicted = model(input_ids=window[:, :-1], use_cache=False).logits.argmax(-1)
            right += int((predicted == window[:, 1:]).sum())
            total += window.shape[1] - 1
    return right / total


def _stderr(line: str, out: TextIO = sys.stderr) -> None:
    print(line, file=out, flush=True)
