"""Recommend a prefill:decode split and decode batch limit for a GPU budget and SLOs.

    python -m planner.cli --seeds-example --gpus 32 --gpus-per-instance 4 \\
        --ttft-slo 2 --itl-slo 0.1 --prompt-tokens 2000 --output-tokens 60

The performance model comes from a probe's measurements (--probe, fitted here; --save-model
keeps the fit), a model fitted earlier (--model), or the seeds' headline figures for a 27B
hybrid on 4xH100 (--seeds-example). Every split of the instances (and the colocated
baseline) is simulated under the workload; goodput is the highest Poisson rate at which
--percentile % of requests meet both SLOs. Writes a JSON result and a PNG of goodput per GPU
against the split beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

from planner.model import PerformanceModel, load_probe
from planner.search import (
    DEFAULT_BATCH_LIMITS,
    Candidate,
    SearchResult,
    SearchSpace,
    search,
)
from planner.simulator import DEFAULT_TOKEN_BUDGET, SLO, Lengths, Workload


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--probe", type=Path, help="probe measurements (JSON) to fit")
    source.add_argument("--model", type=Path, help="a fitted model saved by --save-model")
    source.add_argument("--seeds-example", action="store_true", help="27B hybrid on 4xH100 from the seeds' figures")
    parser.add_argument("--save-model", type=Path, help="write the fitted model here (JSON)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs to place")
    parser.add_argument(
        "--gpus-per-instance", type=int, default=None, help="GPUs per engine instance, its TP size (default: the probe's)"
    )
    parser.add_argument("--ttft-slo", type=float, required=True, help="seconds")
    parser.add_argument("--itl-slo", type=float, required=True, help="seconds, a request's mean inter-token time")
    parser.add_argument("--percentile", type=float, default=90.0, help="%% of requests that must meet both SLOs")
    parser.add_argument("--rate", type=float, help="arrival rate the cluster must serve, req/s (says whether any split can)")
    load = parser.add_argument_group("workload (Poisson arrivals, or a trace)")
    load.add_argument("--prompt-tokens", type=float, default=1000.0, help="mean prompt length")
    load.add_argument("--output-tokens", type=float, default=50.0, help="mean output length")
    load.add_argument("--length-spread", type=float, default=0.2, help="uniform: +-fraction; lognormal: sigma")
    load.add_argument("--length-shape", choices=["uniform", "lognormal"], default="uniform")
    load.add_argument("--requests", type=int, default=600, help="requests per simulation")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--trace", type=Path, help="JSONL rows {arrival_s, prompt_tokens, output_tokens} (planner.trace)")
    space = parser.add_argument_group("search space")
    space.add_argument("--batch-limits", type=int, nargs="+", default=list(DEFAULT_BATCH_LIMITS))
    space.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET, help="prompt tokens per prefill batch")
    space.add_argument("--no-colocated", action="store_true", help="leave out the colocated baseline")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tune.json"), help="JSON; PNG beside it")
    parser.add_argument(
        "--apply",
        metavar="HOST:PORT",
        help="resize a running pdserve router's pools to the recommended split (actors drain before removal)",
    )
    return parser


def _performance_model(args: argparse.Namespace) -> PerformanceModel:
    if args.seeds_example:
        return PerformanceModel.seeds_example()
    if args.model:
        return PerformanceModel.load(args.model)
    return load_probe(args.probe)


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        from planner.trace import parse_trace  # the load generator sends the same format

        specs = parse_trace(args.trace.read_text().splitlines())[: args.requests]
        return Workload.trace((s.arrival_s, s.prompt_tokens, s.output_tokens) for s in specs)
    return Workload.poisson(
        args.requests,
        Lengths(args.prompt_tokens, args.length_spread, args.length_shape),
        Lengths(args.output_tokens, args.length_spread, args.length_shape),
        args.seed,
    )


def _instance_tp(args: argparse.Namespace, model: PerformanceModel) -> int:
    """GPUs per instance: the TP size the figures were measured at (both pools alike)."""
    prefill_tp, decode_tp = model.tensor_parallel
    if prefill_tp != decode_tp:
        raise ValueError(
            f"the probe measured TP {prefill_tp} prefill and TP {decode_tp} decode engines; the tuner sizes both "
            "pools in instances of one size: probe with equal --prefill-tp and --decode-tp"
        )
    if args.gpus_per_instance not in (None, prefill_tp):
        raise ValueError(
            f"--gpus-per-instance {args.gpus_per_instance}, but the figures are for TP {prefill_tp} engines: "
            f"probe engines of TP {args.gpus_per_instance} first, or leave the flag out"
        )
    return prefill_tp


def _space(args: argparse.Namespace, gpus_per_instance: int) -> SearchSpace:
    instances, extra = divmod(args.gpus, gpus_per_instance)
    if extra or instances < 1:
        raise ValueError(f"--gpus {args.gpus} is not a positive multiple of {gpus_per_instance} GPUs per instance")
    return SearchSpace(instances, gpus_per_instance, tuple(args.batch_limits), args.token_budget, not args.no_colocated)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _row(candidate: Candidate) -> str:
    split, summary = candidate.split, candidate.summary
    head = f"{split.label:>12} {split.batch_limit:>6} {candidate.goodput_rps:>10.2f} {candidate.goodput_per_gpu:>9.3f}"
    capacity = candidate.capacity
    tail = f"  {capacity.rate_rps:.2f}, {capacity.bound}-bound" if capacity else ""
    if summary is None:
        return f"{head}   (no rate meets the SLO){tail}"
    return f"{head} {_ms(summary.ttft_s.p90):>9} {_ms(summary.tpot_s.p90):>9} {summary.peak_batch:>6}{tail}"


def report(result: SearchResult, model: PerformanceModel, workload: Workload) -> str:
    space, slo, best = result.space, result.slo, result.best
    lines = [
        f"model: {model.model} on {model.hardware} per instance; {space.instances} instances = {space.gpus} GPUs",
        (
            f"workload: {len(workload)} requests, prompts mean {workload.prompt_tokens.mean():.0f} tokens, "
            f"outputs mean {workload.output_tokens.mean():.0f}"
        ),
        f"SLO: TTFT <= {_ms(slo.ttft_s)} and ITL <= {_ms(slo.itl_s)} for {slo.percentile:g}% of requests",
        "",
        f"{'split':>12} {'limit':>6} {'goodput/s':>10} {'per GPU':>9} {'TTFT p90':>9} {'ITL p90':>9} {'batch':>6}"
        f"  capacity (req/s, bound)",
        *(_row(c) for c in result.best_per_split()),
        "",
    ]
    if best.summary is None:
        return "\n".join([*lines, "no split meets the SLO at any rate: loosen it or add GPUs"])
    s = best.summary
    lines += [
        (
            f"recommended: {best.split.label}, decode batch limit {best.split.batch_limit}: "
            f"goodput {best.goodput_rps:.2f} req/s ({best.goodput_per_gpu:.3f} per GPU){_versus_colocated(result)}"
        ),
        (
            f"  predicted at {s.rate:.2f} req/s: TTFT p50/p90/p99 {_ms(s.ttft_s.p50)} / {_ms(s.ttft_s.p90)} / "
            f"{_ms(s.ttft_s.p99)}; ITL {_ms(s.tpot_s.p50)} / {_ms(s.tpot_s.p90)} / {_ms(s.tpot_s.p99)}; "
            f"e2e {_ms(s.e2e_s.p50)} / {_ms(s.e2e_s.p90)} / {_ms(s.e2e_s.p99)}; "
            f"{s.output_tokens_per_s:.0f} output tok/s; peak decode batch {s.peak_batch}"
        ),
    ]
    if workload.native_rate is not None:
        verdict = "within" if best.goodput_rps >= workload.native_rate else "beyond"
        lines.append(f"  the trace's own rate, {workload.native_rate:.2f} req/s, is {verdict} this goodput")
    return "\n".join(lines)


def _rate_verdict(result: SearchResult, rate: float) -> str:
    best = result.best
    if best.goodput_rps >= rate:
        return f"{rate:g} req/s: met by {best.split.label} (goodput {best.goodput_rps:.2f} req/s)"
    return (
        f"no split of {result.space.instances} instances meets {rate:g} req/s at this SLO: the highest sustainable "
        f"is {best.goodput_rps:.2f} req/s ({best.split.label}); add instances or loosen the SLO"
    )


def _versus_colocated(result: SearchResult) -> str:
    splits = result.best_per_split()
    colocated = splits[0] if splits[0].split.colocated else None
    if colocated is None or result.best is colocated or colocated.goodput_rps == 0:
        return ""
    return f", {result.best.goodput_rps / colocated.goodput_rps:.2f}x colocated ({colocated.goodput_rps:.2f} req/s)"


def _pyplot() -> ModuleType:
    """matplotlib, imported only when plotting, drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(result: SearchResult, path: Path) -> None:
    """Goodput per GPU against the split, one line per decode batch limit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    splits = list(result.space.splits())
    for limit in result.space.batch_limits:
        values = [c.goodput_per_gpu for c in result.candidates if c.split.batch_limit == limit]
        ax.plot(splits, values, marker="o", label=f"batch limit {limit}")
    best = result.best
    ax.plot([best.split.prefill], [best.goodput_per_gpu], marker="*", markersize=16, color="black", label="best")
    labels = {c.split.prefill: c.split.label for c in result.candidates}
    ax.set_xticks(splits, [labels[s] for s in splits], rotation=30)
    slo = result.slo
    ax.set(
        title=f"goodput: p{slo.percentile:g} TTFT <= {slo.ttft_s:g} s and ITL <= {slo.itl_s * 1e3:g} ms",
        xlabel="prefill : decode instances",
        ylabel="requests/s per GPU",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        model = _performance_model(args)
        tp = _instance_tp(args, model)
        space = _space(args, tp)
        workload = _workload(args)
    except (OSError, ValueError, KeyError) as err:
        parser.error(str(err))
    if args.save_model:
        model.save(args.save_model)
    slo = SLO(args.ttft_slo, args.itl_slo, args.percentile)
    result = search(model, workload, slo, space)
    print(report(result, model, workload))
    if args.rate is not None:
        print(_rate_verdict(result, args.rate))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": model.to_dict(),
                "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "slo": asdict(slo),
                "best": asdict(result.best),
                "candidates": [asdict(c) for c in result.candidates],
            },
            indent=1,
        )
    )
    png = args.out.with_suffix(".png")
    plot(result, png)
    print(f"results: {args.out}, plot: {png}")
    if args.apply:
        return _apply(args.apply, result.best.split, tp)
    return 0


def _apply(target: str, split, tp: int) -> int:  # noqa: ANN001 (simulator.Split)
    """Ask the router's Admin service to resize its live pools; it drains what it removes,
    and refuses if its engines are not of the TP size the plan counts in."""
    import asyncio

    import grpc

    from proto.pdserve.v1 import generate_pb2 as pb
    from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc

    async def scale() -> pb.PoolSizes:
        async with grpc.aio.insecure_channel(target) as channel:
            request = pb.ScalePoolsRequest(
                prefill=split.prefill, decode=split.decode, prefill_tp=tp, decode_tp=tp
            )
            return await pb_grpc.AdminStub(channel).ScalePools(request)

    try:
        sizes = asyncio.run(scale())
    except grpc.aio.AioRpcError as err:
        print(f"apply failed: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(
        f"applied: {target} now runs {sizes.prefill} prefill + {sizes.decode} decode actors "
        f"(decode batch limit {split.batch_limit} is an engine setting: restart with --max-num-seqs to apply it)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
