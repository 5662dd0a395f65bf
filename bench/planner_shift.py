"""Closed-loop planner against static splits on a replayed workload shift (simulated).

    python -m bench.planner_shift [--instances 8] [--phase-minutes 20] [--interval 60]

The trace: Poisson arrivals; the first half long generation (prompts ~512, outputs ~2048
tokens: decode-heavy), the second half retrieval-augmented answers (prompts ~3000, outputs
~100: 30:1, inside the seeds' 19:1 to 47:1); lengths lognormal. Each half arrives at --load
(80%) of its own best split's goodput, so both halves load the cluster and no one split
suits both; --rate R instead sends R req/s throughout (only the mix shifts).

The cluster is the seeds' model (Qwen3.5-27B on 4xH100 per instance) with a deliberate
error: prefill x1.25 and decode x0.85 slower/faster than the planner's model (the unscaled
seeds' model), which the planner has to learn through its correction factors.

Compared on the same trace and cluster, each with goodput = requests meeting both SLOs per
second over the whole trace:
- the best static split for the first half: searched with the cluster's own (true) model on
  the first half's mix, the strongest such baseline;
- for context, the best static split in hindsight: every split replayed over the whole trace;
- the closed-loop planner, starting on the first-half split; its changes apply from the next
  interval, the instances changing role serving nothing for --changeover seconds.

Simplifications (planner.replay): each interval is simulated on an empty cluster (requests in
flight at a boundary are not carried over: an overloaded interval's backlog vanishes, which
flatters the static splits), and observations hold the interval's arrivals.
Writes bench/results/planner_shift.json and a PNG of the split and goodput per interval.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.loadgen import write_json
from planner.closed_loop import ClosedLoopPlanner, PlannerConfig
from planner.model import PerformanceModel
from planner.replay import IntervalResult, Phase, Trace, goodput, replay
from planner.search import Candidate, SearchSpace, search
from planner.simulator import SLO, Lengths, Split, Workload

FIRST = (Lengths(512, 0.4, "lognormal"), Lengths(2048, 0.4, "lognormal"))  # long generation
SECOND = (Lengths(3000, 0.4, "lognormal"), Lengths(100, 0.4, "lognormal"))  # RAG, 30:1


def _best_split(
    model: PerformanceModel, lengths: tuple[Lengths, Lengths], config: PlannerConfig, label: str
) -> Candidate:
    workload = Workload.poisson(400, *lengths, seed=1)
    space = SearchSpace(
        config.instances * model.tensor_parallel[0],
        batch_limits=(config.batch_limit,),
        token_budget=config.token_budget,
        include_colocated=False,
    )
    result = search(model, workload, config.slo, space)
    row = ", ".join(f"{c.split.label} {c.goodput_rps:.2f}" for c in result.candidates)
    print(f"{label}: goodput by split (req/s, true model): {row}")
    return result.best


def _series(results: list[IntervalResult]) -> dict[str, list[float]]:
    return {
        "start_s": [r.observation.start_s for r in results],
        "prefill": [r.split.prefill for r in results],
        "goodput_rps": [r.goodput_rps for r in results],
    }


def _plot(
    path: Path, planner: list[IntervalResult], static: list[IntervalResult], static_label: str, shift_s: float
) -> None:
    from bench.loadgen import _pyplot, _save

    plt = _pyplot()
    fig, (split_ax, goodput_ax) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for results, label, style in ((planner, "closed-loop planner", "-"), (static, f"static {static_label}", "--")):
        # Each interval's value held to its end: the last one repeated at the trace's end.
        minutes = [r.observation.start_s / 60 for r in results] + [results[-1].observation.end_s / 60]
        for ax, values in (
            (split_ax, [r.split.prefill for r in results]),
            (goodput_ax, [r.goodput_rps for r in results]),
        ):
            ax.step(minutes, values + values[-1:], style, where="post", label=label)
    for ax in (split_ax, goodput_ax):
        ax.axvline(shift_s / 60, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
    split_ax.set_ylabel("prefill instances")
    split_ax.legend()
    goodput_ax.set_ylabel("goodput per interval (req/s)")
    goodput_ax.set_xlabel("minutes (grey: the mix shifts)")
    _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8, help="instance budget (4 GPUs each in the seeds' model)")
    parser.add_argument("--phase-minutes", type=float, default=20.0, help="length of each half")
    parser.add_argument("--interval", type=float, default=60.0, help="planner interval, seconds")
    parser.add_argument("--cooldown", type=float, default=180.0, help="least seconds between changes")
    parser.add_argument("--hysteresis", type=float, default=0.10, help="least relative goodput gain for a change")
    parser.add_argument("--changeover", type=float, default=30.0, help="seconds a changed instance serves nothing")
    parser.add_argument("--load", type=float, default=0.8, help="each half's rate / its best split's goodput")
    parser.add_argument("--rate", type=float, help="one arrival rate for both halves, req/s (instead of --load)")
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--itl-slo", type=float, default=0.05, help="a request's mean inter-token time, seconds")
    parser.add_argument("--prefill-error", type=float, default=1.25, help="the cluster's prefill time / the model's")
    parser.add_argument("--decode-error", type=float, default=0.85, help="the cluster's decode step / the model's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/planner_shift.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stdout)

    model = PerformanceModel.seeds_example()
    truth = model.scaled(prefill=args.prefill_error, decode=args.decode_error)
    config = PlannerConfig(
        instances=args.instances,
        slo=SLO(args.ttft_slo, args.itl_slo),
        interval_s=args.interval,
        cooldown_s=args.cooldown,
        hysteresis=args.hysteresis,
        seed=args.seed,
    )
    first = _best_split(truth, FIRST, config, "first half (prompt ~512, output ~2048)")
    second = _best_split(truth, SECOND, config, "second half (prompt ~3000, output ~100)")
    rates = (args.rate, args.rate) if args.rate else (args.load * first.goodput_rps, args.load * second.goodput_rps)
    phase_s = args.phase_minutes * 60
    trace = Trace.of([Phase(phase_s, rates[0], *FIRST), Phase(phase_s, rates[1], *SECOND)], seed=args.seed)
    minutes = 2 * phase_s / 60
    print(f"trace: {len(trace.arrival_s)} requests over {minutes:.0f} min at {rates[0]:.2f}, then {rates[1]:.2f} req/s")
    print(
        f"SLO: TTFT {args.ttft_slo} s, ITL {args.itl_slo * 1e3:.0f} ms, p90; cluster = the planner's model with "
        f"prefill x{args.prefill_error}, decode x{args.decode_error}"
    )

    def static(split: Split) -> list[IntervalResult]:
        return replay(truth, trace, split, args.interval, config.slo)

    static_first = static(first.split)
    hindsight = {}
    for prefill in range(1, args.instances):
        split = config.split(prefill, args.instances - prefill)
        hindsight[split.label] = goodput(static(split))
        print(f"static {split.label}: goodput {hindsight[split.label]:.2f} req/s over the trace")
    hindsight_label = max(hindsight, key=hindsight.__getitem__)

    print("closed loop:")
    started = time.perf_counter()
    planner = ClosedLoopPlanner(config, model)
    closed = replay(truth, trace, first.split, args.interval, config.slo, planner, args.changeover)
    elapsed = time.perf_counter() - started
    decisions = [r.decision for r in closed if r.decision is not None]
    searches = [d.search_s for d in decisions if d.search_s > 0]
    changes = [(d.time_s, d.current.label, d.recommended.label) for d in decisions if d.changed]

    planner_goodput, first_goodput = goodput(closed), goodput(static_first)
    ratio = planner_goodput / first_goodput
    best_static = hindsight[hindsight_label]
    print(f"\ngoodput over the trace (requests meeting both SLOs per second, {minutes:.0f} min):")
    rows = [
        ("closed-loop planner", planner_goodput, ""),
        (
            f"static {first.split.label} (first half's best)",
            first_goodput,
            f"planner {ratio:.2f}x (target >= 1.3x)",
        ),
        (f"static {hindsight_label} (best in hindsight)", best_static, f"planner {planner_goodput / best_static:.2f}x"),
    ]
    for label, value, note in rows:
        print(f"  {label:<36} {value:6.2f} req/s   {note}".rstrip())
    print(f"  changes: {', '.join(f'{t / 60:.0f} min {a} -> {b}' for t, a, b in changes) or 'none'}")
    final = planner.corrections
    print(
        f"  corrections at the end: prefill x{final.prefill:.2f}, decode x{final.decode:.2f} "
        f"(the cluster's error: x{args.prefill_error}, x{args.decode_error})"
    )
    print(
        f"  search per interval: median {statistics.median(searches):.2f} s, max {max(searches):.2f} s; "
        f"the whole closed-loop replay {elapsed:.0f} s"
    )

    write_json(
        args.out,
        {
            "config": {**vars(args), "out": str(args.out), "rates": rates},
            "goodput_rps": {"planner": planner_goodput, "static_first_half": first_goodput, "static": hindsight},
            "ratio_vs_first_half": ratio,
            "static_first_half": first.split.label,
            "changes": changes,
            "corrections": asdict(planner.corrections),
            "search_s": {"median": statistics.median(searches), "max": max(searches)},
            "planner": _series(closed),
            "static_first_half_series": _series(static_first),
            "decisions": [d.log_line() for d in decisions],
        },
    )
    png = args.out.with_suffix(".png")
    _plot(png, closed, static_first, first.split.label, phase_s)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
