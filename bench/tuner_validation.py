"""Validate the ratio tuner on this machine: simulator predictions against load-generator
measurements, for the splits that fit here, with the prediction error reported.

One run:
1. probes this machine (cli.probe, reduced to the workload's prompt lengths and decode
   batches 1..32 at the workload's context) and fits the performance model (planner.model);
   or fits a probe file given with --probe;
2. for each split that fits on 2 cores, as bench.goodput_compare deploys them (1 prefill +
   1 decode engine; colocated, 0 prefill + 2 decode engines; one core per engine, the default
   EngineConfig, so the decode batch limit is its max_num_seqs and the prefill token budget its
   max_num_batched_tokens) and for each arrival rate (up to near saturation): simulates the exact
   requests the load generator sends at that rate (same arrival times, prompt and output
   lengths: bench.loadgen.synthetic_workload with the same profile and seed), then brings the
   deployment up with bench.goodput_compare's helpers, sends them, and tears it down;
3. prints, per split and rate, predicted vs measured p50 TTFT and p50 ITL, the relative error
   (predicted - measured) / measured and whether it is within 25% (issue 7's target), and
   writes everything (probe, fitted model, per-point figures) to bench/results/tuner_validation.json.

ITL here is a request's mean inter-token time (the simulator's TPOT and the load generator's
per-request ITL, the statistic both SLOs use); the p50 is over requests. Both sides take
percentiles over the same requests (those the load generator completed) with the same
interpolation. Nothing is tuned to the measurements: the model is the plain fit of the probe.

    python -m bench.tuner_validation [--rates 0.5 1 1.5 2 3 4] [--num-requests 30] [--probe probe.json]

About 6 minutes on this machine with the defaults (probe ~40 s, each deployment ~2.5 min).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

from bench.loadgen import PROFILES, LoadConfig, RunReport, percentile, synthetic_workload
from planner.model import PerformanceModel, TransferCost
from planner.simulator import Split, Timeline, Workload, simulate
from planner.trace import RequestSpec
from vllm_engine.config import EngineConfig, resolve_model

if TYPE_CHECKING:
    from bench.goodput_compare import System

# The deployment side (bench.goodput_compare, cli.probe, Ray) imports vLLM and Ray: it is
# imported in run() only, so the comparison above it stays importable in a fast unit test.

TOLERANCE = 0.25  # issue 7: predictions within 25% of measurements
METRICS = ("ttft", "itl")  # p50 of TTFT; p50 over requests of a request's mean inter-token time
# req/s: light load up to where the disaggregated pair's one prefill core nears saturation
# (bench.goodput_compare: both splits hold the SLO for >= 98% of requests at 4 req/s).
DEFAULT_RATES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0)

# The default workload's prompts are 640-1440 tokens (mean ~1000), outputs 40-60: probe
# prefill around those lengths and decode at that context, batches 1..32 (the deployments'
# limit is 16; 32 lets the fit see past the knee if there is one). cli.probe.ProbeConfig's fields.
VALIDATION_PROBE: dict[str, Any] = {
    "prompt_lengths": (512, 1024, 1536),
    "prefill_batches": (1, 2, 4),
    "decode_batches": (1, 2, 4, 8, 16, 32),
    "decode_context": 1024,
    "decode_steps": 48,
    "transfer_lengths": (512, 1024, 2048, 4096),
}


# --- the comparison (pure) -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Point:
    """One metric of one split at one rate."""

    split: str
    rate: float
    metric: str  # "ttft" or "itl"
    predicted_s: float | None
    measured_s: float | None
    relative_error: float | None  # (predicted - measured) / measured
    within_target: bool | None  # |relative_error| <= tolerance; None when not comparable


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return (predicted - measured) / measured


def compare(
    split: str,
    rate: float,
    predicted: dict[str, float | None],
    measured: dict[str, float | None],
    tolerance: float = TOLERANCE,
) -> list[Point]:
    points = []
    for metric in METRICS:
        error = relative_error(predicted.get(metric), measured.get(metric))
        within = None if error is None else abs(error) <= tolerance
        points.append(Point(split, rate, metric, predicted.get(metric), measured.get(metric), error, within))
    return points


def _p50(values: Sequence[float]) -> float | None:
    return percentile(values, 50) if len(values) else None


def predicted_p50s(timeline: Timeline, indices: Sequence[int] | None = None) -> dict[str, float | None]:
    """p50 TTFT and p50 per-request mean ITL of the simulated requests `indices` (all when
    None), with the load generator's percentile; single-token outputs have no ITL."""
    chosen = np.arange(len(timeline.arrival)) if indices is None else np.asarray(indices, dtype=int)
    ttft = timeline.ttft[chosen]
    itl = timeline.tpot[chosen][timeline.output_tokens[chosen] > 1]
    return {"ttft": _p50(ttft.tolist()), "itl": _p50(itl.tolist())}


def measured_p50s(report: RunReport) -> dict[str, float | None]:
    s = report.summary
    return {"ttft": s.ttft_s.p50, "itl": s.request_itl_s.p50}


def completed_indices(report: RunReport) -> list[int]:
    return sorted(r.index for r in report.requests if r.completed)


def per_request(timeline: Timeline, report: RunReport) -> list[dict[str, Any]]:
    """Predicted next to measured TTFT and mean ITL, request by request (None: not completed)."""
    rows = []
    for record in sorted(report.requests, key=lambda r: r.index):
        i = record.index
        rows.append(
            {
                "index": i,
                "arrival_s": record.arrival_s,
                "prompt_tokens": record.prompt_tokens,
                "output_tokens": record.output_tokens,
                "predicted_ttft_s": float(timeline.ttft[i]),
                "measured_ttft_s": record.token_times_s[0] if record.completed else None,
                "predicted_itl_s": float(timeline.tpot[i]),
                "measured_itl_s": record.itl_s("mean") if record.completed else None,
            }
        )
    return rows


def error_summary(points: Sequence[Point], tolerance: float = TOLERANCE) -> dict[str, dict[str, Any]]:
    """Per metric and over all: comparable points, within target, mean and max |error|."""

    def stats(chosen: list[Point]) -> dict[str, Any]:
        errors = [abs(p.relative_error) for p in chosen if p.relative_error is not None]
        return {
            "points": len(errors),
            "within_target": sum(e <= tolerance for e in errors),
            "mean_abs_error": statistics.fmean(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
        }

    out = {metric: stats([p for p in points if p.metric == metric]) for metric in METRICS}
    out["all"] = stats(list(points))
    return out


def workload_of(specs: Sequence[RequestSpec]) -> Workload:
    """The load generator's requests as a simulator workload, index for index. Simulated at
    rate 1 (`arrivals(1.0)` is these arrival times unscaled), so the simulator sees exactly
    the arrival offsets, prompt and output lengths that are sent."""
    ordered = sorted(specs, key=lambda s: s.index)
    if [s.index for s in ordered] != list(range(len(ordered))):
        raise ValueError("specs must be indexed 0..n-1")
    return Workload(
        np.array([s.arrival_s for s in ordered], dtype=float),
        np.array([s.prompt_tokens for s in ordered], dtype=np.int64),
        np.array([s.output_tokens for s in ordered], dtype=np.int64),
    )


def split_of(system: System, engine: EngineConfig) -> Split:
    """The simulated counterpart of a deployment: its engines' batch limit and token budget."""
    return Split(
        prefill=system.num_prefill,
        decode=system.num_decode,
        batch_limit=engine.max_num_seqs,
        token_budget=engine.max_num_batched_tokens,
    )


# --- model -----------------------------------------------------------------------------


def fit_model(probe: dict[str, Any]) -> tuple[PerformanceModel, str]:
    """The plain fit; if the probe's few transfer rows show no growth with bytes (a few ms of
    noise on sub-5-MB pulls), transfer is taken as their median, flat. Says which."""
    try:
        return PerformanceModel.from_probe(probe), "fitted"
    except ValueError as err:
        if "transfer" not in str(err):
            raise
    median = statistics.median(row["seconds"] for row in probe["transfer"])
    model = PerformanceModel.from_probe(probe, transfer=TransferCost(median, 1e18))
    return model, f"transfer rows show no growth with bytes: flat {median * 1e3:.1f} ms (their median)"


def describe(model: PerformanceModel, prompt: int = 1000) -> str:
    p, d = model.prefill, model.decode
    return "\n".join(
        [
            (
                f"model: prefill {prompt} tokens {p.seconds(prompt, prompt**2) * 1e3:.0f} ms "
                f"(fixed {p.fixed_s * 1e3:.1f} ms, {p.per_token_s * 1e6:.1f} us/token, "
                f"rms error {p.rms_relative_error:.0%})"
            ),
            (
                f"       decode step at context {prompt}: batch 1 {d.seconds(1, prompt) * 1e3:.1f} ms, "
                f"batch 16 {d.seconds(16, 16 * prompt) * 1e3:.1f} ms "
                f"(knee {d.knee:g}, rms error {d.rms_relative_error:.0%})"
            ),
            (
                f"       transfer of a {prompt}-token request {model.transfer_seconds(prompt) * 1e3:.1f} ms "
                f"({model.layout.transfer_bytes(prompt):,} B; rms error {model.transfer.rms_relative_error:.0%})"
            ),
            f"       serving path (gRPC, router, feeds) {model.serving_overhead_s * 1e3:.1f} ms per request",
            (
                "       host: engines have their cores to themselves"
                if model.host is None
                else (
                    f"       host: {model.host.background_cores:.2f} cores busy outside the engines + "
                    f"{model.host.cpu_s_per_token * 1e3:.2f} ms CPU per streamed token, over {model.host.cores} "
                    f"engine cores (x{model.host.slowdown(100):.2f} at 100 tok/s)"
                )
            ),
        ]
    )


# --- the run ---------------------------------------------------------------------------


def _engine_processes() -> list[psutil.Process]:
    """Ray worker processes of this cluster still hosting a prefill/decode engine actor."""
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            title = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and ("PrefillActor" in title or "DecodeActor" in title):
            found.append(process)
    return found


async def _wait_engines_gone(timeout_s: float = 60.0) -> None:
    # The probe's engines are killed, not awaited: the measured deployments must not start
    # beside them (as bench.goodput_compare waits between its deployments).
    deadline = time.monotonic() + timeout_s
    while _engine_processes() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def _specs(rate: float, config: LoadConfig) -> list[RequestSpec]:
    # What bench.loadgen.sweep sends at this rate (run_workload skips arrivals past the limit).
    specs = synthetic_workload(rate, config.num_requests, config.profile, config.seed)
    return [s for s in specs if s.arrival_s < config.time_limit_s]


def predict(model: PerformanceModel, split: Split, specs: Sequence[RequestSpec]) -> Timeline:
    return simulate(model, split, workload_of(specs), 1.0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.goodput_compare import SYSTEMS, measure
    from cli.probe import ProbeConfig, run_probe
    from cli.probe import report as probe_report

    engine = EngineConfig()
    model_path = resolve_model(args.model)
    started = time.perf_counter()
    if args.probe:
        probe_data = json.loads(args.probe.read_text())
        probe_data = probe_data.get("probe", probe_data)  # a probe file, or this script's JSON
        print(f"probe: {args.probe}", file=sys.stderr)
    else:
        print("probing (reduced cli.probe) ...", file=sys.stderr)
        probe = await run_probe(ProbeConfig(**VALIDATION_PROBE))
        print(probe_report(probe), file=sys.stderr)
        probe_data = asdict(probe)
        await _wait_engines_gone()
    probe_s = time.perf_counter() - started
    model, transfer_note = fit_model(probe_data)
    print(describe(model), file=sys.stderr)
    if transfer_note != "fitted":
        print(f"       ({transfer_note})", file=sys.stderr)

    rates = sorted(args.rates)
    config = LoadConfig(
        num_requests=args.num_requests,
        # Long enough that every request of the slowest rate is sent, plus room to finish.
        time_limit_s=args.num_requests / rates[0] + 60.0,
        profile=PROFILES[args.profile],
        seed=args.seed,
        warmup=2,
        progress=not args.no_progress,
    )
    points: list[Point] = []
    runs: list[dict[str, Any]] = []
    for system in SYSTEMS:
        split = split_of(system, engine)
        label = split.label  # 1P:1D, 2 colocated
        # Predictions first, from the model alone.
        timelines = {rate: predict(model, split, _specs(rate, config)) for rate in rates}
        for rate, timeline in timelines.items():
            p = predicted_p50s(timeline)
            print(
                f"{label} at {rate:g} req/s predicted: TTFT p50 {_ms(p['ttft'])}, ITL p50 {_ms(p['itl'])}, "
                f"peak decode batch {timeline.peak_batch}",
                file=sys.stderr,
            )
        measure_started = time.perf_counter()
        reports = await measure(system, model_path, rates, config)
        measure_s = time.perf_counter() - measure_started
        for report in reports:
            rate = float(report.rate)
            timeline = timelines[rate]
            done = completed_indices(report)
            predicted = predicted_p50s(timeline, done)
            measured = measured_p50s(report)
            points += compare(label, rate, predicted, measured)
            s = report.summary
            runs.append(
                {
                    "split": label,
                    "engines": asdict(split),
                    "rate": rate,
                    "sent": s.sent,
                    "completed": s.completed,
                    "predicted_p50_s": predicted,
                    "measured_p50_s": measured,
                    "predicted_p90_s": {
                        "ttft": percentile(timeline.ttft[done].tolist(), 90) if done else None,
                        "itl": percentile(timeline.tpot[done].tolist(), 90) if done else None,
                    },
                    "measured_p90_s": {"ttft": s.ttft_s.p90, "itl": s.request_itl_s.p90},
                    "measured_gap_itl_p50_s": s.itl_s.p50,  # every token gap, as the client saw them
                    "predicted_peak_batch": timeline.peak_batch,
                    "max_send_lag_s": max((r.sent_s - r.arrival_s for r in report.requests), default=0.0),
                    "deployment_wall_s": measure_s,
                    "requests": per_request(timeline, report),
                }
            )
    return {
        "tolerance": TOLERANCE,
        "metrics": {
            "ttft": "p50 over requests of time to first token (client send -> first token)",
            "itl": "p50 over requests of a request's mean inter-token time",
        },
        "engine": {"max_num_seqs": engine.max_num_seqs, "max_num_batched_tokens": engine.max_num_batched_tokens},
        "load": {
            "rates": rates,
            "num_requests": config.num_requests,
            "profile": args.profile,
            "seed": config.seed,
            "time_limit_s": config.time_limit_s,
        },
        "probe_config": None if args.probe else VALIDATION_PROBE,
        "probe": probe_data,
        "probe_wall_s": probe_s,
        "model": model.to_dict(),
        "transfer_fit": transfer_note,
        "runs": runs,
        "points": [asdict(p) for p in points],
        "errors": error_summary(points),
    }


# --- output ----------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _error(point: Point) -> str:
    if point.relative_error is None:
        return f"{'-':>6} {'-':>3}"
    return f"{point.relative_error:+6.0%} {'yes' if point.within_target else 'no':>3}"


def table(points: Sequence[Point]) -> str:
    by_key: dict[tuple[str, float], dict[str, Point]] = {}
    for p in points:
        by_key.setdefault((p.split, p.rate), {})[p.metric] = p
    lines = [
        (
            f"{'split':>11} {'rate':>5} | {'TTFT p50 pred':>13} {'measured':>10} {'error':>6} {'ok':>3} | "
            f"{'ITL p50 pred':>12} {'measured':>10} {'error':>6} {'ok':>3}"
        ),
    ]
    for (split, rate), row in by_key.items():
        t, i = row["ttft"], row["itl"]
        lines.append(
            f"{split:>11} {rate:5g} | {_ms(t.predicted_s):>13} {_ms(t.measured_s):>10} {_error(t)} | "
            f"{_ms(i.predicted_s):>12} {_ms(i.measured_s):>10} {_error(i)}"
        )
    return "\n".join(lines)


def summary_lines(errors: dict[str, dict[str, Any]], tolerance: float = TOLERANCE) -> list[str]:
    lines = []
    for name, s in errors.items():
        if not s["points"]:
            continue
        lines.append(
            f"{name:>4}: {s['within_target']}/{s['points']} within {tolerance:.0%}; "
            f"mean |error| {s['mean_abs_error']:.0%}, max {s['max_abs_error']:.0%}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="req/s")
    parser.add_argument("--num-requests", type=int, default=30, help="per rate and split")
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default", help="length distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="embedded")
    parser.add_argument(
        "--probe", type=Path, help="fit this probe JSON instead of probing (this script's JSON works too)"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/tuner_validation.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    load_before = os.getloadavg()[1]
    from cluster.ray_cluster import start_local

    start_local()
    result = asyncio.run(run(args))
    result["wall_s"] = time.perf_counter() - started
    # Anything else on the 2 cores shows up in the measurements: say how busy they were.
    result["load_average_5min"] = {"start": load_before, "end": os.getloadavg()[1]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    points = [Point(**p) for p in result["points"]]
    print(f"\nsimulator vs load generator, {args.num_requests} requests per run, profile {args.profile}")
    print(table(points))
    print("(error = (predicted - measured) / measured; ok = within the issue's 25%)")
    print("\n".join(summary_lines(result["errors"])))
    print(f"results: {args.out}; wall time {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
