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
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from configuration.fields import knob, section
from configuration.flags import add_flags, build
from messages.timings import SLO
from planner.model import PerformanceModel, load_probe
from planner.search import Candidate, SearchResult, SearchSpace, search
from planner.simulator import Workload, WorkloadConfig

TUNE_FIXED = frozenset({"itl-stat"})  # the simulator judges a request's mean inter-token time only


@dataclass(frozen=True, slots=True)
class TuneConfig:
    # Where the performance model comes from: exactly one of the three.
    probe: str | None = knob(None, help="probe measurements (JSON) to fit")
    model: str | None = knob(None, help="a fitted model saved by --save-model")
    seeds_example: bool = knob(False, help="27B hybrid on 4xH100 from the seeds' figures")
    save_model: str | None = knob(None, help="write the fitted model here (JSON)")
    space: SearchSpace = section(SearchSpace, title="search space")
    slo: SLO = section(SLO, title="SLO")
    rate: float | None = knob(None, help="arrival rate the cluster must serve, req/s (says whether any split can)")
    workload: WorkloadConfig = section(WorkloadConfig, title="workload (Poisson arrivals, or a trace)")
    out: str = knob("bench/results/tune.json", help="JSON; PNG beside it")
    apply: str | None = knob(
        None, help="HOST:PORT: resize a running pdserve router's pools to the recommended split (engines drain first)"
    )

    def __post_init__(self) -> None:
        if (self.probe is not None) + (self.model is not None) + self.seeds_example != 1:
            raise ValueError("probe, model, seeds_example: give exactly one of --probe, --model and --seeds-example")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 req/s, got {self.rate}")

    def performance_model(self) -> PerformanceModel:
        if self.seeds_example:
            return PerformanceModel.seeds_example()
        if self.model:
            return PerformanceModel.load(Path(self.model))
        return load_probe(Path(self.probe))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, TuneConfig, TUNE_FIXED)
    return parser


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
    try:
        config = build(TuneConfig, parser.parse_args(argv))
        model = config.performance_model()
        space = config.space.sized_for(model)
        workload = config.workload.build()
    except (OSError, ValueError, KeyError) as err:
        parser.error(str(err))
    if config.save_model:
        model.save(Path(config.save_model))
    result = search(model, workload, config.slo, space)
    print(report(result, model, workload))
    if config.rate is not None:
        print(_rate_verdict(result, config.rate))
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "model": model.to_dict(),
                "arguments": asdict(config),
                "slo": asdict(config.slo),
                "best": asdict(result.best),
                "candidates": [asdict(c) for c in result.candidates],
            },
            indent=1,
        )
    )
    png = out.with_suffix(".png")
    plot(result, png)
    print(f"results: {out}, plot: {png}")
    if config.apply:
        return _apply(config.apply, result.best.split, space.gpus_per_instance)
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
