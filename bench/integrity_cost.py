"""What the integrity guard costs the traffic it checks: transfer digests
(kv_transfer.digests) and shadow verification (router/shadow_verification.py).

One 1P+1D deployment, the same Poisson arrivals in alternating phases: nothing checked;
every handoff's digests checked (`digest_fraction` 1); a tenth and every request
shadow-verified (--verify-fraction 1: the most it can cost). Each phase sends prompts of its
own (no prefix hits across phases). Prints TTFT and time per output token side by side, the
shadow checks' verdicts, what a shadow fraction F costs by linear share (F x the cost at 1),
and what a digest costs per MB of state on this box (block_digests over a bf16 cache, once
on the producer and once on the consumer per handoff). Plots them.

    python -m bench.integrity_cost [--rate 0.5] [--requests 30] [--rounds 2] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cluster.ray_cluster import start_local
from controller.deployment import DeploymentConfig
from controller.local_stack import LocalStack
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from router.shadow_verification import ShadowVerifier
from vllm_engine.config import EngineConfig, resolve_model


@dataclass(frozen=True, slots=True)
class Checks:
    name: str
    digest_fraction: float
    verify_fraction: float


CHECKS = (
    Checks("off", 0.0, 0.0),
    Checks("digests, every handoff", 1.0, 0.0),
    Checks("shadow 0.1", 0.0, 0.1),
    Checks("shadow 1", 0.0, 1.0),
)


@dataclass(frozen=True, slots=True)
class Phase:
    checks: str
    ttft_s: list[float]
    tpot_s: list[float]
    agreed: int
    diverged: int

    def summary(self) -> dict[str, float]:
        q = statistics.quantiles
        return {
            "ttft_p50_ms": statistics.median(self.ttft_s) * 1e3,
            "ttft_p90_ms": q(self.ttft_s, n=10)[-1] * 1e3,
            "tpot_mean_ms": statistics.fmean(self.tpot_s) * 1e3,
            "tpot_p90_ms": q(self.tpot_s, n=10)[-1] * 1e3,
        }


async def _one(orchestrator, request: GenerateRequest, at: float) -> tuple[float, float]:
    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    start, times = time.perf_counter(), []
    async for event in orchestrator.generate(request):
        if not isinstance(event, GenerationResult):
            times.extend([time.perf_counter()] * len(event.token_ids))
    return times[0] - start, (times[-1] - times[0]) / (len(times) - 1)


async def _set_digest_fraction(stack: LocalStack, fraction: float) -> None:
    """On every prefill engine's producer half. The deployment's TransferConfig fixes it for
    the engines' life; a benchmark alternating phases on the same engines sets it in place."""

    def apply(actor) -> None:  # runs in the actor
        actor._producer._transfer = dataclasses.replace(actor._producer._transfer, digest_fraction=fraction)

    await asyncio.gather(*(m.actor.__ray_call__.remote(apply) for m in stack.deployment.prefill.members))


async def _phase(stack: LocalStack, checks: Checks, args: argparse.Namespace, seed: int) -> Phase:
    """Arrivals from `seed` (the same for every phase of a round); prompts never seen."""
    orchestrator = stack.orchestrator
    await _set_digest_fraction(stack, checks.digest_fraction)
    orchestrator.shadow = ShadowVerifier(checks.verify_fraction, args.verify_tokens) if checks.verify_fraction else None
    arrivals, prompts = random.Random(seed), random.Random()
    sampling = SamplingConfig(max_tokens=args.max_tokens, ignore_eos=True)
    at, jobs = time.perf_counter(), []
    for i in range(args.requests):
        at += arrivals.expovariate(args.rate)
        prompt = tuple(prompts.randint(1, 2000) for _ in range(args.prompt_tokens))
        jobs.append(_one(orchestrator, GenerateRequest(f"integrity-{seed}-{checks.name}-{i}", prompt, sampling), at))
    measured = await asyncio.gather(*jobs)
    verdicts = []
    if orchestrator.shadow is not None:
        await orchestrator.shadow.settled()
        verdicts = list(orchestrator.shadow.verdicts)
    orchestrator.shadow = None
    agreed = sum(v.agrees for v in verdicts)
    return Phase(checks.name, [m[0] for m in measured], [m[1] for m in measured], agreed, len(verdicts) - agreed)


async def run(args: argparse.Namespace) -> list[Phase]:
    config = DeploymentConfig(engine=EngineConfig(model=resolve_model(args.model)))
    stack = await LocalStack(config, text_prompts=False).start()
    phases: list[Phase] = []
    try:
        await _phase(stack, CHECKS[0], argparse.Namespace(**{**vars(args), "requests": 4}), seed=0)  # warm-up
        for round_ in range(args.rounds):
            for checks in CHECKS:
                phase = await _phase(stack, checks, args, seed=round_ + 1)  # same load per round
                phases.append(phase)
                s = phase.summary()
                print(
                    f"round {round_ + 1}/{args.rounds}, {checks.name}: TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                    f"TPOT mean {s['tpot_mean_ms']:.1f} ms, shadow checks agreed {phase.agreed}, "
                    f"diverged {phase.diverged}",
                    flush=True,
                )
    finally:
        await stack.stop()
    return phases


def digest_ms_per_mb(megabytes: int = 64, repeats: int = 5) -> float:
    """block_digests over a bf16 attention cache of `megabytes`, in 128-token blocks: the
    fastest of `repeats` (one side of a handoff)."""
    import torch

    from kv_transfer.digests import block_digests

    blocks = megabytes * 2**20 // (2 * 128 * 8 * 128 * 2)
    cache = torch.randn(2, blocks, 8, 128, 128, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        block_digests([cache], list(range(blocks)), blocks)
        best = min(best, time.perf_counter() - started)
    return best * 1e3 / megabytes


def _merged(phases: list[Phase], name: str) -> Phase:
    mine = [p for p in phases if p.checks == name]
    return Phase(
        name,
        [x for p in mine for x in p.ttft_s],
        [x for p in mine for x in p.tpot_s],
        sum(p.agreed for p in mine),
        sum(p.diverged for p in mine),
    )


def plot(summaries: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = ["#4c72b0", "#c44e52", "#55a868", "#dd8452"]
    for ax, key, title in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms)"), (axes[1], "tpot_mean_ms", "TPOT mean (ms)")):
        ax.bar(list(summaries), [s[key] for s in summaries.values()], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle("Integrity guard: what each check costs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--requests", type=int, default=30, help="per phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--verify-tokens", type=int, default=16)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("bench/results/integrity_cost.json"))
    args = parser.parse_args()
    per_mb = digest_ms_per_mb()
    print(f"a digest costs {per_mb:.2f} ms per MB of state on this box (each side of a handoff)", flush=True)
    start_local()
    phases = asyncio.run(run(args))
    summaries = {c.name: _merged(phases, c.name).summary() for c in CHECKS}
    off, digests, every = summaries["off"], summaries["digests, every handoff"], summaries["shadow 1"]
    shadow_tpot = every["tpot_mean_ms"] / off["tpot_mean_ms"] - 1
    shadowed = [_merged(phases, c.name) for c in CHECKS if c.verify_fraction]
    print(
        f"\n{args.rounds} rounds x {args.requests} requests per phase, {args.rate:g} req/s, "
        f"{args.prompt_tokens}-token prompts"
    )
    print("| checks | TTFT p50 / p90 (ms) | TPOT mean / p90 (ms) |")
    print("|---|---|---|")
    for name, s in summaries.items():
        ttft, tpot = (
            f"{s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f}",
            f"{s['tpot_mean_ms']:.1f} / {s['tpot_p90_ms']:.1f}",
        )
        print(f"| {name} | {ttft} | {tpot} |")
    print(f"shadow checks: {sum(c.agreed for c in shadowed)} agreed, {sum(c.diverged for c in shadowed)} diverged")
    print(
        f"digests on every handoff: TTFT p50 {digests['ttft_p50_ms'] / off['ttft_p50_ms'] - 1:+.1%}, "
        f"TPOT {digests['tpot_mean_ms'] / off['tpot_mean_ms'] - 1:+.1%}"
    )
    print(
        f"TPOT with every request shadow-checked: {shadow_tpot:+.1%}; at a fraction F the expected cost is F x "
        f"that: {0.01 * shadow_tpot:+.2%} at 1% (target <= 1%)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "digest_ms_per_mb": per_mb,
                "summaries": summaries,
                "phases": [asdict(p) for p in phases],
            },
            indent=2,
        )
    )
    plot(summaries, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
