"""What shadow verification (router/shadow_verification.py) costs the traffic it checks.

One 1P+1D deployment, the same Poisson arrivals in alternating phases: no checks, a tenth of
the requests checked, every request checked (--verify-fraction 1: the most it can cost). Each
phase sends prompts of its own (no prefix hits across phases). Prints TTFT and time per
output token side by side, the checks' verdicts, and what a fraction F costs by linear share:
F x (TPOT with every request checked / TPOT without - 1). Plots them.

    python -m bench.shadow_cost [--rate 0.5] [--requests 30] [--rounds 2] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
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

FRACTIONS = (0.0, 0.1, 1.0)


@dataclass(frozen=True, slots=True)
class Phase:
    fraction: float
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


async def _phase(orchestrator, fraction: float, args: argparse.Namespace, seed: int) -> Phase:
    """Arrivals from `seed` (the same for every fraction of a round); prompts never seen."""
    orchestrator.shadow = ShadowVerifier(fraction, args.verify_tokens) if fraction else None
    arrivals, prompts = random.Random(seed), random.Random()
    sampling = SamplingConfig(max_tokens=args.max_tokens, ignore_eos=True)
    at, jobs = time.perf_counter(), []
    for i in range(args.requests):
        at += arrivals.expovariate(args.rate)
        prompt = tuple(prompts.randint(1, 2000) for _ in range(args.prompt_tokens))
        jobs.append(_one(orchestrator, GenerateRequest(f"shadow-cost-{seed}-{fraction}-{i}", prompt, sampling), at))
    measured = await asyncio.gather(*jobs)
    verdicts = []
    if orchestrator.shadow is not None:
        await orchestrator.shadow.settled()
        verdicts = list(orchestrator.shadow.verdicts)
    orchestrator.shadow = None
    agreed = sum(v.agrees for v in verdicts)
    return Phase(fraction, [m[0] for m in measured], [m[1] for m in measured], agreed, len(verdicts) - agreed)


async def run(args: argparse.Namespace) -> list[Phase]:
    config = DeploymentConfig(engine=EngineConfig(model=resolve_model(args.model)))
    stack = await LocalStack(config, text_prompts=False).start()
    phases: list[Phase] = []
    try:
        await _phase(stack.orchestrator, 0.0, argparse.Namespace(**{**vars(args), "requests": 4}), seed=0)  # warm-up
        for round_ in range(args.rounds):
            for fraction in FRACTIONS:
                phase = await _phase(stack.orchestrator, fraction, args, seed=round_ + 1)  # same load per round
                phases.append(phase)
                s = phase.summary()
                print(
                    f"round {round_ + 1}/{args.rounds}, verify fraction {fraction:g}: TTFT p50 "
                    f"{s['ttft_p50_ms']:.0f} ms, TPOT mean {s['tpot_mean_ms']:.1f} ms, "
                    f"checks agreed {phase.agreed}, diverged {phase.diverged}",
                    flush=True,
                )
    finally:
        await stack.stop()
    return phases


def _merged(phases: list[Phase], fraction: float) -> Phase:
    mine = [p for p in phases if p.fraction == fraction]
    return Phase(
        fraction,
        [x for p in mine for x in p.ttft_s],
        [x for p in mine for x in p.tpot_s],
        sum(p.agreed for p in mine),
        sum(p.diverged for p in mine),
    )


def plot(summaries: dict[float, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    labels = [f"verify {f:g}" for f in summaries]
    for ax, key, title in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms)"), (axes[1], "tpot_mean_ms", "TPOT mean (ms)")):
        ax.bar(labels, [s[key] for s in summaries.values()], color=["#4c72b0", "#55a868", "#dd8452"])
        ax.set_title(title)
    fig.suptitle("Shadow verification: cost by share of requests checked")
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
    parser.add_argument("--out", type=Path, default=Path("bench/results/shadow_cost.json"))
    args = parser.parse_args()
    start_local()
    phases = asyncio.run(run(args))
    summaries = {f: _merged(phases, f).summary() for f in FRACTIONS}
    off, every = summaries[0.0], summaries[1.0]
    tpot_cost = every["tpot_mean_ms"] / off["tpot_mean_ms"] - 1
    checked = [_merged(phases, f) for f in FRACTIONS if f]
    print(
        f"\n{args.rounds} rounds x {args.requests} requests per side, {args.rate:g} req/s, "
        f"{args.prompt_tokens}-token prompts"
    )
    print("| verify fraction | TTFT p50 / p90 (ms) | TPOT mean / p90 (ms) |")
    print("|---|---|---|")
    for fraction, s in summaries.items():
        print(
            f"| {fraction:g} | {s['ttft_p50_ms']:.0f} / {s['ttft_p90_ms']:.0f} | "
            f"{s['tpot_mean_ms']:.1f} / {s['tpot_p90_ms']:.1f} |"
        )
    print(f"checks: {sum(c.agreed for c in checked)} agreed, {sum(c.diverged for c in checked)} diverged")
    print(
        f"TPOT with every request checked: {tpot_cost:+.1%}; at a fraction F the expected cost is F x that: "
        f"{0.01 * tpot_cost:+.2%} at 1% (target <= 1%)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
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
