"""The closed-loop planner on real engines: one traffic shift, served with and without it.

Both runs start at the same split (1P:2D by default, three engines oversubscribing this
box's cores) and get the same requests through gRPC: a decode-heavy first half (short
prompts, long answers), then a prefill-heavy second half (long prompts, short answers).
One `pdserve serve` has `--planner` (with a performance model fitted on this machine:
`pdserve probe`, then the tuner's fit); the other keeps its split. Prints TTFT and ITL p90,
goodput per half and the planner's decisions, and the second half's ratios.

    python -m bench.planner_live [--probe bench/results/probe.json] [--half 60] [--interval 10] [--no-switch-roles]

Without `--probe` (or if the file is missing) it runs the probe first (a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.loadgen import LengthProfile, LoadConfig, RequestRecord, run_workload, synthetic_workload
from bench.server_process import ServerProcess
from messages.timings import SLO, percentile
from planner.trace import RequestSpec

DECODE_HEAVY = LengthProfile((96, 128), (0.5, 1.5))  # ~110-token prompts, ~110-token answers
PREFILL_HEAVY = LengthProfile((4, 8), (150.0, 250.0))  # ~1,200-token prompts, ~6-token answers


@dataclass(frozen=True, slots=True)
class Half:
    ttft_p90_s: float | None
    itl_p90_s: float | None
    goodput_rps: float
    completed: int
    failed: int


def _half(records: list[RequestRecord], slo: SLO, seconds: float) -> Half:
    done = [r for r in records if r.completed]
    itls = [itl for r in done if (itl := r.itl_s(slo.itl_stat)) is not None]
    return Half(
        percentile([r.token_times_s[0] for r in done], 90) if done else None,
        percentile(itls, 90) if itls else None,
        sum(r.meets(slo) for r in records) / seconds,
        len(done),
        sum(1 for r in records if r.error),
    )


def shifted_workload(args: argparse.Namespace) -> list[RequestSpec]:
    first = synthetic_workload(args.decode_rate, int(args.decode_rate * args.half), DECODE_HEAVY, seed=1)
    second = synthetic_workload(args.prefill_rate, int(args.prefill_rate * args.half), PREFILL_HEAVY, seed=2)
    first = [s for s in first if s.arrival_s < args.half]
    return first + [
        RequestSpec(len(first) + s.index, args.half + s.arrival_s, s.prompt_tokens, s.output_tokens)
        for s in second
        if s.arrival_s < args.half
    ]


def fitted_model(args: argparse.Namespace, workdir: Path) -> Path:
    probe = args.probe
    if probe is None or not probe.exists():
        probe = probe or workdir / "probe.json"
        print(f"probing this machine (pdserve probe --out {probe}) ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "cli.probe", "--out", str(probe)], check=True)
    model = workdir / "model.json"
    from planner.model import load_probe

    load_probe(probe).save(model)
    return model


class _Served:
    def __init__(self, args: argparse.Namespace, model: Path | None, port: int) -> None:
        self.target = f"127.0.0.1:{port}"
        self.label = "planner" if model else "static"
        command = [
            sys.executable,
            "-m",
            "cli.main",
            "serve",
            "--prefill",
            str(args.prefill),
            "--decode",
            str(args.decode),
        ]
        command += ["--listen", self.target, "--metrics-port", "0", "--drain-timeout", "5"]
        if args.switch_roles:
            command += ["--switch-roles"]
        if model:
            command += ["--planner", "--planner-model", str(model), "--interval", str(args.interval)]
            command += [
                "--cooldown",
                str(args.cooldown),
                "--ttft-slo",
                str(args.ttft_slo),
                "--itl-slo",
                str(args.itl_slo),
            ]
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"planner-live-{self.label}-", suffix=".log")
        print(f"starting pdserve serve ({self.label}, {args.prefill}P:{args.decode}D) ...", file=sys.stderr, flush=True)
        self.server = ServerProcess(command, self.log)

    def wait_serving(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while "serving pdserve.v1.Generation" not in Path(self.log.name).read_text():
            if self.server.exited or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve serve did not come up:\n{Path(self.log.name).read_text()[-2000:]}")
            time.sleep(1)

    def planner_lines(self) -> list[str]:
        return [line for line in Path(self.log.name).read_text().splitlines() if line.startswith("planner ")]

    def stop(self) -> None:
        self.server.stop(signal.SIGTERM, timeout_s=90)


async def _drive(target: str, specs: list[RequestSpec], args: argparse.Namespace) -> list[RequestRecord]:
    slo = SLO(args.ttft_slo, args.itl_slo)
    config = LoadConfig(num_requests=len(specs), time_limit_s=2 * args.half + 120, slo=slo, warmup=0)
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(8)]
    try:
        report = await run_workload(channels, specs, config, "shift", None)
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    return report.requests


def run(args: argparse.Namespace) -> dict:
    slo = SLO(args.ttft_slo, args.itl_slo)
    specs = shifted_workload(args)
    with tempfile.TemporaryDirectory(prefix="planner-live-") as tmp:
        model = fitted_model(args, Path(tmp))
        results = {}
        for port, label_model in ((args.port, model), (args.port + 1, None)):
            served = _Served(args, label_model, port)
            try:
                served.wait_serving()
                records = asyncio.run(_drive(served.target, specs, args))
                time.sleep(1)
                lines = served.planner_lines()
            finally:
                served.stop()
            first = [r for r in records if r.arrival_s < args.half]
            second = [r for r in records if r.arrival_s >= args.half]
            results[served.label] = {
                "first_half": asdict(_half(first, slo, args.half)),
                "second_half": asdict(_half(second, slo, args.half)),
                "planner": lines,
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner_live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", type=Path, help="a probe of this machine (default: run one)")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--half", type=float, default=60.0, help="seconds of each traffic mix")
    parser.add_argument("--decode-rate", type=float, default=2.0, help="req/s of the decode-heavy half")
    parser.add_argument("--prefill-rate", type=float, default=3.0, help="req/s of the prefill-heavy half")
    parser.add_argument(
        "--switch-roles",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="both runs serve with --switch-roles: a split change moves an engine (no restart)",
    )
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--cooldown", type=float, default=20.0)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--itl-slo", type=float, default=0.05)
    parser.add_argument("--port", type=int, default=50091)
    parser.add_argument("--out", type=Path, default=Path("bench/results/planner_live.json"))
    args = parser.parse_args(argv)
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    change = "moving an engine" if args.switch_roles else "restarting engines"
    print(
        f"\n{args.prefill}P:{args.decode}D at start, a split change by {change}; "
        f"{args.half:.0f} s decode-heavy at {args.decode_rate} req/s, then "
        f"{args.half:.0f} s prefill-heavy at {args.prefill_rate} req/s; "
        f"SLO TTFT <= {args.ttft_slo} s, ITL <= {args.itl_slo} s"
    )
    for label, result in results.items():
        for half in ("first_half", "second_half"):
            h = result[half]
            ttft = f"{h['ttft_p90_s'] * 1e3:.0f} ms" if h["ttft_p90_s"] is not None else "-"
            itl = f"{h['itl_p90_s'] * 1e3:.0f} ms" if h["itl_p90_s"] is not None else "-"
            print(
                f"  {label:>8} {half.replace('_', ' ')}: TTFT p90 {ttft}, ITL p90 {itl}, goodput "
                f"{h['goodput_rps']:.2f} req/s, {h['completed']} completed, {h['failed']} failed"
            )
    for line in results["planner"]["planner"]:
        print(f"  {line}")
    planned, static = results["planner"]["second_half"], results["static"]["second_half"]
    if planned["ttft_p90_s"] and static["ttft_p90_s"]:
        print(f"second half, planner / static: TTFT p90 {planned['ttft_p90_s'] / static['ttft_p90_s']:.2f}x")
    if static["goodput_rps"]:
        print(f"second half, planner / static: goodput {planned['goodput_rps'] / static['goodput_rps']:.2f}x")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
