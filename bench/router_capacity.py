"""Where the serving stack's CPU goes per streamed token, measured with the real engines.

Starts `pdserve serve` (a controller, N router actors, 1 prefill + 2 decode actors by
default), streams C concurrent gRPC requests of T tokens through it (one connection per
stream, so routers sharing the port all get some; kept across rounds, as gRPC clients keep
their channels, unless --fresh-connections), and reads the process CPU time (user +
system) of the router processes and of each decode actor before and after. Prints CPU
milliseconds per streamed token for the routers and for the decode actor processes, and how
much of the latter is outside the engine step (the engines' own
`pdserve_engine_step_cpu_seconds_total`, scraped through `--prometheus-sd-file`).

    python -m bench.router_capacity [--streams 16] [--tokens 128] [--rounds 3]
                                    [--worker-niceness 15 0] [--routers 1 2 [--router-cpu 0.05]]

The routers' CPU is also split by thread: Python's main thread (asyncio: gRPC handlers,
orchestrator, protobuf) apart from Ray's C++ IO thread and gRPC's pollers. With
`--worker-niceness A B` or `--routers A B` one server per value runs, their rounds
interleaved, and the ratios are printed; `--baseline-tree DIR` adds a server running the
code of another checkout, to measure a change side by side. `--router-cpu F` caps every router process at F
of a core (a CPU cgroup each): the router is then the bottleneck, which shows how tokens/s
grows with the number of routers when the engines are not what limits it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen import LengthProfile, LoadConfig, run_workload, synthetic_workload
from bench.server_process import ServerProcess
from messages.timings import LatencySummary


@dataclass(frozen=True, slots=True)
class Round:
    tokens: int
    seconds: float
    router_cpu_s: float
    decode_cpu_s: float
    decode_step_cpu_s: float  # of which in engine steps (the engines' own counter)
    itl_s: LatencySummary
    router_threads_s: dict[str, float]  # router CPU seconds by thread name

    @property
    def router_ms_per_token(self) -> float:
        return 1e3 * self.router_cpu_s / self.tokens

    @property
    def decode_ms_per_token(self) -> float:
        return 1e3 * self.decode_cpu_s / self.tokens

    @property
    def decode_serving_ms_per_token(self) -> float:
        """Decode actors' CPU outside the engine step: Ray, asyncio, feeds, output objects."""
        return 1e3 * (self.decode_cpu_s - self.decode_step_cpu_s) / self.tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _cpu_by_thread(process: psutil.Process) -> dict[str, float]:
    """CPU seconds per thread name (Ray's C++ core worker and gRPC threads are named;
    Python's main thread carries the asyncio loop: gRPC server, orchestrator, protobuf)."""
    totals: dict[str, float] = {}
    for thread in process.threads():
        try:
            name = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:  # ended meanwhile
            continue
        name = "main (asyncio)" if thread.id == process.pid else name.rstrip("0123456789")
        totals[name] = totals.get(name, 0.0) + thread.user_time + thread.system_time
    return totals


def _actors(serve: psutil.Process, actor_class: str) -> list[psutil.Process]:
    """This cluster's actors of one class: Ray names worker processes after the actor class."""
    mine = {c.pid for c in serve.children(recursive=True)}
    processes = psutil.process_iter(["pid", "cmdline"])
    return [p for p in processes if p.pid in mine and actor_class in " ".join(p.info["cmdline"] or [])]


class _CpuCap:
    """A CPU cgroup per process holding it to `fraction` of a core (cgroup v1 or v2)."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        v1 = Path("/sys/fs/cgroup/cpu")
        self._root = v1 if (v1 / "cpu.cfs_quota_us").exists() else Path("/sys/fs/cgroup")
        self._groups: list[Path] = []

    def apply(self, process: psutil.Process) -> None:
        group = self._root / f"pdserve-bench-{process.pid}"
        try:
            group.mkdir(exist_ok=True)
            period = 100_000
            if self._root.name == "cpu":
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(int(self.fraction * period)))
            else:
                (group / "cpu.max").write_text(f"{int(self.fraction * period)} {period}")
            (group / "cgroup.procs").write_text(str(process.pid))
        except OSError as err:
            raise SystemExit(f"--router-cpu needs a writable CPU cgroup ({group}: {err}); run without it") from None
        self._groups.append(group)

    def release(self) -> None:
        for group in self._groups:
            for pid in (group / "cgroup.procs").read_text().split():
                (self._root / "cgroup.procs").write_text(pid)
            group.rmdir()
        self._groups.clear()


async def _wait_ready(target: str, timeout_s: float) -> None:
    from router.client import build_request, stream_generate

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                async for _ in stream_generate(channel, build_request([1, 2, 3, 4], max_tokens=2), timeout_s=30):
                    pass
            return
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


def _connect(target: str, streams: int) -> list[grpc.aio.Channel]:
    """One connection per stream: gRPC shares one between channels to the same target unless
    each has its own subchannel pool."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    return [grpc.aio.insecure_channel(target, options=options) for _ in range(streams)]


async def _round(
    channels: list[grpc.aio.Channel], config: LoadConfig, seed: int
) -> tuple[int, float, LatencySummary]:
    specs = synthetic_workload(1e6, config.num_requests, config.profile, seed)  # all at once
    started = time.perf_counter()
    report = await run_workload(channels, specs, config, "round", None)
    if report.summary.completed != len(specs):
        raise RuntimeError(f"{len(specs) - report.summary.completed} of {len(specs)} streams failed")
    tokens = sum(len(r.token_times_s) for r in report.requests)
    return tokens, time.perf_counter() - started, report.summary.itl_s


class _Server:
    """One `pdserve serve` process (its own local cluster); `niceness`: its engines' nice
    value (Ray's RAY_worker_niceness), None for pdserve's default; `routers`: --routers."""

    def __init__(self, args: argparse.Namespace, niceness: str | None, routers: int, tree: Path | None = None) -> None:
        parts = [f"engines at nice {niceness}" if niceness is not None else "", f"{routers} router(s)"]
        if tree is not None:
            parts.append(f"code from {tree}")
        if args.router_cpu:
            parts.append(f"{args.router_cpu:g} core each")
        self.label = ", ".join(p for p in parts if p)
        self.target = f"127.0.0.1:{_free_port()}"
        command = [sys.executable, "-m", "cli.main", "serve", "--prefill", str(args.prefill), "--routers", str(routers)]
        command += ["--decode", str(args.decode), "--listen", self.target, "--metrics-port", "0"]
        command += ["--max-num-seqs", str(max(16, args.streams))]
        self._sd_dir = tempfile.TemporaryDirectory(prefix="router-capacity-")
        self.sd_file = Path(self._sd_dir.name) / "workers.json"
        command += ["--prometheus-sd-file", str(self.sd_file)]
        env = dict(os.environ) | ({"RAY_worker_niceness": niceness} if niceness is not None else {})
        print(f"starting pdserve serve ({args.prefill}P + {args.decode}D, {self.label}) ...", file=sys.stderr)
        # Ray's workers import from the driver's sys.path, whose first entry is its cwd.
        self.server = ServerProcess(command, env=env, cwd=tree)
        self.serve = psutil.Process(self.server.pid)
        self.routers: list[psutil.Process] = []
        self.decode: list[psutil.Process] = []
        self.expected = {"RouterActor": routers, "DecodeActor": args.decode}
        self.cap = _CpuCap(args.router_cpu) if args.router_cpu else None
        self.fresh_connections = args.fresh_connections
        self.channels: list[grpc.aio.Channel] = []

    async def ready(self, config: LoadConfig) -> None:
        await _wait_ready(self.target, timeout_s=300)
        self.routers, self.decode = (_actors(self.serve, name) for name in ("RouterActor", "DecodeActor"))
        for found, (name, expected) in zip((self.routers, self.decode), self.expected.items()):
            if len(found) != expected:
                raise RuntimeError(f"found {len(found)} {name} processes, expected {expected}")
        for router in self.routers if self.cap else ():
            self.cap.apply(router)
        self.channels = _connect(self.target, config.num_requests)
        await _round(self.channels, config, seed=1000)  # warm: connections, handshakes, first steps

    def _routers_by_thread(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for router in self.routers:
            for name, seconds in _cpu_by_thread(router).items():
                totals[name] = totals.get(name, 0.0) + seconds
        return totals

    async def round(self, config: LoadConfig, seed: int) -> Round:
        if self.fresh_connections:  # the routers' CPU then includes accepting them
            await asyncio.gather(*(channel.close() for channel in self.channels))
            self.channels = _connect(self.target, config.num_requests)
        before = (_cpu_s(self.routers), _cpu_s(self.decode), self._step_cpu_s(), self._routers_by_thread())
        tokens, seconds, itl = await _round(self.channels, config, seed)
        after = (_cpu_s(self.routers), _cpu_s(self.decode), self._step_cpu_s(), self._routers_by_thread())
        threads = {name: t - before[3].get(name, 0.0) for name, t in after[3].items()}
        deltas = [a - b for a, b in zip(after[:3], before[:3])]
        return Round(tokens, seconds, *deltas, itl, threads)

    def _step_cpu_s(self) -> float:
        """The decode engines' step CPU, scraped from the workers' metrics endpoints."""
        total = 0.0
        for group in json.loads(self.sd_file.read_text()):
            if group["labels"]["role"] != "decode":
                continue
            text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=10).text
            for family in text_string_to_metric_families(text):
                if family.name == "pdserve_engine_step_cpu_seconds":
                    total += sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
        return total

    async def stop(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))
        if self.cap is not None:
            self.cap.release()
        self.server.stop()  # SIGINT: serve shuts its cluster down
        self._sd_dir.cleanup()


async def measure(args: argparse.Namespace) -> dict[str, list[Round]]:
    """Rounds per server, interleaved (round 1 on each, then round 2 ...) so that the box's
    drift over the run falls on every configuration alike."""
    ratio = args.prompt_tokens / args.tokens
    profile = LengthProfile((args.tokens, args.tokens), (ratio, ratio))
    config = LoadConfig(num_requests=args.streams, profile=profile, time_limit_s=600, warmup=0, progress=False)
    servers = [_Server(args, None, args.routers[0], args.baseline_tree)] if args.baseline_tree else []
    servers += [_Server(args, n, r) for n in (args.worker_niceness or [None]) for r in args.routers]
    try:
        for server in servers:
            await server.ready(config)
        rounds: dict[str, list[Round]] = {s.label: [] for s in servers}
        for i in range(args.rounds):
            for server in servers:
                r = await server.round(config, seed=i)
                rounds[server.label].append(r)
                print(
                    f"round {i + 1}/{args.rounds}, {server.label}: {r.tokens} tokens in {r.seconds:.1f}s; "
                    f"router {r.router_ms_per_token:.3f} ms CPU/token, decode actors {r.decode_ms_per_token:.3f}",
                    file=sys.stderr,
                )
        return rounds
    finally:
        for server in servers:
            await server.stop()


def _median(rounds: list[Round]) -> Round:
    return sorted(rounds, key=lambda r: r.router_ms_per_token)[len(rounds) // 2]


def _itl_ms(rounds: list[Round]) -> tuple[float, float, list[float]]:
    """Inter-token p50 and p99, each the median over rounds (a round's tail follows the
    box's scheduling: one round is not a measurement), and every round's p99."""
    p99s = sorted(1e3 * r.itl_s.p99 for r in rounds)
    p50s = sorted(1e3 * r.itl_s.p50 for r in rounds)
    return p50s[len(p50s) // 2], p99s[len(p99s) // 2], p99s


def _print_summary(rounds: list[Round]) -> None:
    median = _median(rounds)
    best = min(rounds, key=lambda r: r.router_ms_per_token)
    print(
        f"  routers' CPU per streamed token:      {median.router_ms_per_token:.3f} ms "
        f"(median; best {best.router_ms_per_token:.3f})"
    )
    print(
        f"  decode actors' CPU per streamed token: {median.decode_ms_per_token:.3f} ms, of which outside the "
        f"engine step {median.decode_serving_ms_per_token:.3f} ms"
    )
    print(f"  tokens/s through the router:          {median.tokens / median.seconds:.0f}")
    p50, p99, p99s = _itl_ms(rounds)
    print(
        f"  inter-token p50 / p99:                {p50:.1f} / {p99:.1f} ms (medians over rounds; "
        f"p99 per round {', '.join(f'{x:.0f}' for x in p99s)})"
    )
    print(f"  one router core carries about:        {1e3 / median.router_ms_per_token:,.0f} tokens/s")
    print("  router CPU by thread (ms per token):")
    for name, seconds in sorted(median.router_threads_s.items(), key=lambda kv: -kv[1]):
        if seconds * 1e3 / median.tokens >= 0.005:
            print(f"    {name:<28} {1e3 * seconds / median.tokens:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16, help="concurrent streams per round")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens per stream")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--worker-niceness", nargs="+", metavar="N", help="compare engines at these nice values (Ray's default: 15)"
    )
    parser.add_argument("--routers", type=int, nargs="+", default=[1], help="compare these router counts")
    parser.add_argument("--router-cpu", type=float, help="cap each router process at this fraction of a core")
    parser.add_argument(
        "--fresh-connections",
        action="store_true",
        help="open new connections every round (default: each stream keeps its connection, as gRPC clients should)",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="also run pdserve from this checkout (e.g. `git worktree add /tmp/base HEAD~1`) and compare",
    )
    parser.add_argument("--json", type=Path, help="write the rounds here")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args))
    shape = f"{args.streams} streams x {args.tokens} tokens through {args.prefill}P + {args.decode}D"
    print(f"\n{shape}, {args.rounds} rounds each")
    for label, rounds in results.items():
        print(f"{label}:")
        _print_summary(rounds)
    if len(results) > 1:
        (base_label, base_rounds), *others = results.items()
        base, (base_p50, base_p99, _) = _median(base_rounds), _itl_ms(base_rounds)
        for label, rounds in others:
            other, (p50, p99, _) = _median(rounds), _itl_ms(rounds)
            print(
                f"{label} / {base_label}: router CPU per token "
                f"{other.router_ms_per_token / base.router_ms_per_token:.2f}x, "
                f"tokens/s {(other.tokens / other.seconds) / (base.tokens / base.seconds):.2f}x, "
                f"inter-token p50 {p50 / base_p50:.2f}x, p99 {p99 / base_p99:.2f}x"
            )
    if args.json:
        args.json.write_text(json.dumps({k: [asdict(r) for r in rounds] for k, rounds in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
