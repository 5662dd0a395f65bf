"""Overload: does goodput hold when twice as many requests arrive as the pools can serve?

One 1 prefill + 1 decode deployment behind the real gRPC front door, or its OpenAI front
(`--front http`), with admission derived from the decode pool, as `pdserve serve` runs it.
The same Poisson workload (bench.loadgen) at a rate near saturation, then at twice that rate.
Reports, side by side in one run:
- completed requests per second at each rate, and the ratio overload / saturation
  (target >= 0.9: admitted requests do not die of the excess);
- how fast the excess is turned away: RESOURCE_EXHAUSTED (HTTP 429) latency p50/p99 (target
  p99 < 50 ms);
- how many requests failed any other way (target 0).

    python -m bench.overload [--rate 4] [--num-requests 150] [--time-limit 40] [--front http]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.loadgen import RunReport, add_load_args, load_config, percentile, sweep, sweep_http, write_json
from controller.deployment import DeploymentConfig
from controller.local_stack import LocalStack
from cluster.ray_cluster import start_local
from router.server import admission_limits
from vllm_engine.config import EngineConfig, resolve_model


@dataclass(frozen=True, slots=True)
class RateResult:
    rate: float
    sent: int
    completed: int
    rejected: int
    failed: int  # any other error
    completed_per_s: float
    rejection_p50_ms: float | None
    rejection_p99_ms: float | None


def result_of(report: RunReport) -> RateResult:
    rejections = [r.end_s for r in report.requests if r.error == "RESOURCE_EXHAUSTED"]
    failed = sum(1 for r in report.requests if r.error and r.error != "RESOURCE_EXHAUSTED")
    return RateResult(
        rate=report.rate or 0.0,
        sent=report.summary.sent,
        completed=report.summary.completed,
        rejected=len(rejections),
        failed=failed,
        completed_per_s=report.summary.throughput_rps,
        rejection_p50_ms=percentile(rejections, 50) * 1e3 if rejections else None,
        rejection_p99_ms=percentile(rejections, 99) * 1e3 if rejections else None,
    )


async def run(model: str, rate: float, args: argparse.Namespace) -> list[RateResult]:
    http = "127.0.0.1:0" if args.front == "http" else None
    config = DeploymentConfig(engine=EngineConfig(model=model))
    async with LocalStack(config, http=http, served_model_name="bench", text_prompts=False) as stack:
        limits = admission_limits(stack.orchestrator, stack.server.front)
        print(f"admission: {limits.max_in_flight} in flight, {limits.max_queue} waiting", file=sys.stderr)
        rates = [rate, 2 * rate]
        if http:
            reports = await sweep_http(f"http://{stack.http.address}", rates, load_config(args))
        else:
            reports = await sweep(stack.address, rates, load_config(args))
    return [result_of(r) for r in reports]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def plot(results: list[RateResult], path: Path) -> None:
    from bench.loadgen import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = [f"{r.rate:g} req/s" for r in results]
    ax.bar(labels, [r.completed_per_s for r in results], color=["#4c72b0", "#dd8452"])
    ax.set_ylabel("completed requests / s")
    ax.set_title("1P+1D: saturation vs 2x overload (admission on)")
    for i, r in enumerate(results):
        ax.annotate(
            f"{r.rejected} refused, p99 {_ms(r.rejection_p99_ms)}",
            (i, r.completed_per_s),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rate", type=float, default=4.0, help="near saturation, req/s (README: ~4-5 here)")
    parser.add_argument("--front", choices=["grpc", "http"], default="grpc", help="gRPC, or the OpenAI front (429s)")
    add_load_args(parser, num_requests=150, time_limit_s=40.0, out=Path("bench/results/overload.json"))
    args = parser.parse_args(argv)
    start_local()
    results = asyncio.run(run(resolve_model(args.model), args.rate, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, [asdict(r) for r in results])
    plot(results, args.out.with_suffix(".png"))
    print(
        f"\n{'rate':>9} {'sent':>5} {'done':>5} {'refused':>8} {'failed':>7} {'done/s':>7} "
        f"{'refusal p50':>12} {'p99':>10}"
    )
    for r in results:
        print(
            f"{r.rate:>5g} r/s {r.sent:>5} {r.completed:>5} {r.rejected:>8} {r.failed:>7} {r.completed_per_s:>7.2f} "
            f"{_ms(r.rejection_p50_ms):>12} {_ms(r.rejection_p99_ms):>10}"
        )
    saturated, overloaded = results
    ratio = overloaded.completed_per_s / saturated.completed_per_s if saturated.completed_per_s else 0.0
    print(
        f"\ncompleted/s at 2x overload / at saturation: {ratio:.2f}x (target >= 0.9); "
        f"refusal p99 {_ms(overloaded.rejection_p99_ms)} (target < 50 ms); other failures {overloaded.failed}"
    )
    print(f"results: {args.out}, plot: {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
