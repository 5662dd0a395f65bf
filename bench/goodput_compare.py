"""Goodput of disaggregated vs colocated serving on the same cores, side by side, one command.

Brings up, one after the other (never more than two engines alive), behind the same router
code and gRPC server in this process:
- disaggregated: 1 prefill + 1 decode engine (one core each);
- colocated: 0 prefill + 2 decode engines that prefill themselves (one core each);
and sweeps the same Poisson arrival rates with the same requests (bench.loadgen) on each.
Prints goodput per rate, the ratio disaggregated / colocated, and where each saturates:
the peak goodput (where it stops growing) and the highest rate whose SLO attainment is
still >= 90% (DistServe's per-system goodput).

Default SLOs, for the default ~1000-token prompts / ~50-token outputs on this 2-core CPU
box: TTFT <= 1 s and a request's mean inter-token time <= 25 ms. A lone request sees TTFT
130-190 ms and 8-12 ms per token on either system (README table; first sweep point), so the
TTFT SLO (~5x) leaves room to queue behind a few prefills, and the ITL SLO (~2.5x, a stream
of >= 40 tok/s) is where a prefill stalling the decode batch starts to show. Both loosen
with --ttft-slo / --itl-slo; with ITL 50 ms the comparison is about raw capacity only.

Bounded: rates x --num-requests requests per system, each rate cut at --time-limit seconds;
the defaults finish in about 4-5 minutes (at most ~9) on this machine.

    python -m bench.goodput_compare [--rates 1 2 3 4 5] [--num-requests 40] [--itl-slo 0.05]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench.loadgen import (
    LoadConfig,
    RunReport,
    add_load_args,
    load_config,
    plot_cdfs,
    plot_goodput,
    sweep,
    write_json,
)
from controller.deployment import Deployment, DeploymentConfig
from controller.local_stack import LocalStack
from cluster.ray_cluster import start_local
from vllm_engine.config import EngineConfig, resolve_model

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True, slots=True)
class System:
    name: str
    num_prefill: int
    num_decode: int


# Same total cores (DeploymentConfig pins one engine per core).
SYSTEMS = (System("disaggregated", 1, 1), System("colocated", 0, 2))


@dataclass(frozen=True, slots=True)
class Saturation:
    peak_goodput_rps: float
    peak_rate: float  # goodput stops growing past this rate
    max_rate_within_slo: float | None  # highest rate before attainment first drops below target


def saturation(reports: Sequence[RunReport]) -> Saturation:
    """Reports in increasing rate order."""
    peak = max(reports, key=lambda r: r.summary.goodput_rps)
    within = None
    for report in reports:
        if report.summary.slo_attainment < ATTAINMENT_TARGET:
            break
        within = report.rate
    return Saturation(peak.summary.goodput_rps, peak.rate, within)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


async def _actor_pids(deployment: Deployment) -> list[int]:
    members = deployment.prefill.members + deployment.decode.members
    return list(await asyncio.gather(*(m.actor.pid.remote() for m in members)))


async def _wait_exited(pids: Sequence[int], timeout_s: float = 60.0) -> None:
    # ray.kill returns before the engine processes are gone: the next deployment's engines
    # must not start beside them (cores, memory).
    deadline = time.monotonic() + timeout_s
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


async def measure(system: System, model: str, rates: Sequence[float], config: LoadConfig) -> list[RunReport]:
    stack = LocalStack(
        DeploymentConfig(
            engine=EngineConfig(model=model), num_prefill=system.num_prefill, num_decode=system.num_decode
        ),
        text_prompts=False,
    )
    started = time.perf_counter()
    pids: list[int] = []
    try:
        await stack.start()
        pids = await _actor_pids(stack.deployment)
        print(f"{system.name}: up in {time.perf_counter() - started:.0f} s on {stack.address}", file=sys.stderr)
        return await sweep(stack.address, rates, config, label=f"{system.name} ")
    finally:
        await stack.stop()
        # Anything else running on the cores shows up in the numbers: say how busy it was.
        print(f"{system.name}: done, 5-min load average {os.getloadavg()[1]:.1f}", file=sys.stderr)
        await _wait_exited(pids)


def _cell(report: RunReport) -> str:
    s = report.summary
    ttft = s.ttft_s.p90
    itl = s.request_itl_s.p90
    return (
        f"{s.goodput_rps:5.2f} {s.slo_attainment:5.0%} "
        f"{'-' if ttft is None else f'{ttft * 1e3:6.0f}':>6} {'-' if itl is None else f'{itl * 1e3:5.1f}':>5}"
    )


def print_table(results: dict[str, list[RunReport]]) -> None:
    disagg, coloc = results["disaggregated"], results["colocated"]
    slo = disagg[0].slo
    print(f"\nSLO: TTFT <= {slo.ttft_s * 1e3:g} ms and per-request {slo.itl_stat} ITL <= {slo.itl_s * 1e3:g} ms")
    header = "goodput  SLO%  TTFTp90 ITLp90"
    print(f"{'rate':>5} | {'disaggregated':^29} | {'colocated':^29} | goodput ratio")
    print(f"{'req/s':>5} | {header} | {header} | disagg / coloc")
    for d, c in zip(disagg, coloc):
        print(f"{d.rate:5g} | {_cell(d):>29} | {_cell(c):>29} | {_ratio(d.summary.goodput_rps, c.summary.goodput_rps)}")
    print("(goodput req/s; SLO% = share of requests meeting both SLOs; TTFT ms; ITL = p90 of per-request ITL, ms)")
    for name, reports in results.items():
        s = saturation(reports)
        within = "none" if s.max_rate_within_slo is None else f"{s.max_rate_within_slo:g} req/s"
        print(
            f"{name:>13}: peak goodput {s.peak_goodput_rps:.2f} req/s at {s.peak_rate:g} req/s; "
            f"highest rate with >= {ATTAINMENT_TARGET:.0%} within SLO: {within}"
        )
    d, c = saturation(disagg), saturation(coloc)
    print(f"peak goodput ratio disaggregated / colocated: {_ratio(d.peak_goodput_rps, c.peak_goodput_rps)}")


async def compare(model: str, rates: Sequence[float], config: LoadConfig) -> dict[str, list[RunReport]]:
    # Sequential, one deployment at a time: both get the machine's cores to themselves.
    return {system.name: await measure(system, model, rates, config) for system in SYSTEMS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 2, 3, 4, 5], help="req/s")
    parser.add_argument("--model", default="embedded")
    add_load_args(parser, num_requests=40, time_limit_s=45.0, out=Path("bench/results/goodput_compare.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    start_local()
    results = asyncio.run(compare(resolve_model(args.model), sorted(args.rates), load_config(args)))
    write_json(args.out, {name: [asdict(r) for r in reports] for name, reports in results.items()})
    plot_goodput(results, args.out.with_name(f"{args.out.stem}_goodput.png"))
    plot_cdfs(results, args.out.with_name(f"{args.out.stem}_cdf.png"))
    print_table(results)
    print(f"results: {args.out} (+ _goodput.png, _cdf.png); wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
