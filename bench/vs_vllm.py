"""pdserve against the stack a user would pick instead: stock vLLM OpenAI servers, one per core.

Same machine, same model (the embedded one unless --model), same cores, same open-loop
workload, all driven by vLLM's own serving benchmark (`vllm bench serve`, over HTTP):
- stock vLLM: one `vllm.entrypoints.openai.api_server` per core (pinned with
  VLLM_CPU_OMP_THREADS_BIND, its defaults otherwise), each fed half of the Poisson stream
  (a random split of a Poisson stream is two Poisson streams at half the rate); pdserve's
  one front door gets both halves, the same arrivals and prompts;
- pdserve colocated: `pdserve serve --prefill 0 --decode 2 --http ...`;
- pdserve 1P+1D: `pdserve serve --prefill 1 --decode 1 --http ...`;
pdserve's engines compiled like the stock servers' (`--no-enforce-eager`; `--pdserve-eager`
runs pdserve's CPU default instead).
The systems take turns, one up at a time (each needs both cores, and an idle one is not
idle: stock vLLM's CPU workers spin, pdserve's controller polls): a turn starts a system,
drives every rate on it and stops it. Each round gives every system a turn, in the opposite
order the next round, so a slow or fast spell of this shared machine falls on all of them
alike instead of on whichever system ran then. A system's point at a rate pools its rounds
(goodput: good requests over the summed durations of its turns). Requests are judged by one
SLO (TTFT and a request's p90 inter-token gap, as the issue defines it) with pdserve's
percentile definition, from the benchmark's per-request records.

    python -m bench.vs_vllm [--rates 1 3 5 7] [--requests 40] [--rounds 2] [--input-len 1024] [--output-len 50]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.server_process import ServerProcess, stop_all
from messages.timings import SLO, LatencySummary, percentile
from vllm_engine.config import EMBEDDED_MODEL, resolve_model

MODEL_NAME = "bench"
# The SLO: TTFT <= 1 s and a request's p90 inter-token gap <= 50 ms.
DEFAULT_SLO = SLO(ttft_s=1.0, itl_s=0.050, itl_stat="p90")


@dataclass(frozen=True, slots=True)
class RatePoint:
    system: str
    rate: float
    sent: int
    completed: int
    ttft_s: LatencySummary
    tpot_s: LatencySummary  # per request mean inter-token time
    itl_s: LatencySummary  # every gap of every request
    goodput_rps: float
    slo_attainment: float


class PortTakenError(RuntimeError):
    """A port `_free_port` found free was taken before the server bound it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_first(tree: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(tree.resolve()), os.environ.get("PYTHONPATH")) if p)}


class _System:
    """Server processes behind one or more base URLs."""

    def __init__(
        self, name: str, commands: list[tuple[list[str], dict[str, str], str]], cwd: Path | None = None
    ) -> None:
        """`cwd`: run from this checkout. Its path goes first on PYTHONPATH too: pdserve's
        editable install imports `vllm_engine` from the installed checkout as every interpreter
        starts (the torchvision shim's .pth), before the cwd is on the path; Ray's workers
        inherit the variable."""
        self.name = name
        self.urls = [url for _, _, url in commands]
        prefix = "vs-vllm-" + "".join(c if c.isalnum() or c in "+." else "-" for c in name) + "-"
        self._log = tempfile.NamedTemporaryFile(prefix=prefix, suffix=".log", delete=False)
        print(f"starting {name} (log: {self._log.name}) ...", file=sys.stderr)
        self._servers = [
            ServerProcess(command, self._log, {**os.environ, **env, **(_import_first(cwd) if cwd else {})}, cwd)
            for command, env, _ in commands
        ]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for url in self.urls:
            while True:
                if any(server.exited for server in self._servers):
                    taken = "Address already in use" in Path(self._log.name).read_text(errors="replace")
                    error = PortTakenError if taken else RuntimeError
                    raise error(f"{self.name} exited during start-up: see {self._log.name}")
                try:
                    if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready in {timeout_s:.0f}s: see {self._log.name}")
                time.sleep(1)

    def stop(self) -> None:
        stop_all(self._servers)


def stock_vllm(model: str, cores: list[int], kv_cache_bytes: int, flags: tuple[str, ...] = ()) -> _System:
    """One stock vLLM OpenAI server per core; `flags`: more `vllm serve` flags for each."""
    commands = []
    for core in cores:
        port = _free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
        command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
        command += ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(kv_cache_bytes), *flags]
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_PLUGINS": ""}  # stock: no pdserve plugin
        commands.append((command, env, f"http://127.0.0.1:{port}"))
    return _System(f"stock vLLM x{len(cores)}", commands)


def pdserve(
    model: str,
    prefill: int,
    decode: int,
    eager: bool,
    engine_path: str = "auto",
    flags: str = "",
    tree: Path | None = None,
) -> _System:
    port = _free_port()
    command = [sys.executable, "-m", "cli.main", "serve", "--model", model, "--prefill", str(prefill)]
    command += ["--decode", str(decode), "--listen", f"127.0.0.1:{_free_port()}", "--metrics-port", "0"]
    command += ["--http", f"127.0.0.1:{port}", "--served-model-name", MODEL_NAME]
    command += ["--enforce-eager" if eager else "--no-enforce-eager", "--engine-path", engine_path, *flags.split()]
    name = "pdserve colocated" if prefill == 0 else f"pdserve {prefill}P+{decode}D"
    name += " (eager)" if eager else ""
    name += f" ({engine_path})" if engine_path != "auto" else ""
    name += f" ({flags})" if flags else ""
    name += f" (code from {tree})" if tree else ""
    return _System(name, [(command, {}, f"http://127.0.0.1:{port}")], tree)


def _bench(
    urls: list[str], model: str, rate: float, args: argparse.Namespace, out_dir: Path, clients: int
) -> list[dict]:
    """`clients` concurrent `vllm bench serve` processes, each at rate/clients with its own
    seed, client i against URL i mod len(urls); per-request records. Every system gets the
    same clients, hence the same arrivals and prompts: a run's length (and so goodput at
    100% in SLO) then differs only by how fast the system serves them."""
    runs = []
    for i in range(clients):
        result = out_dir / f"r{rate}-{i}.json"
        command = [
            sys.executable,
            "-m",
            "bench.vllm_bench_serve",
            "--backend",
            "openai",
            "--base-url",
            urls[i % len(urls)],
        ]
        command += ["--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", model]
        command += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
        command += ["--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos"]
        command += ["--num-prompts", str(max(1, args.requests // clients)), "--request-rate", str(rate / clients)]
        command += ["--seed", str(args.seed + i), "--save-result", "--save-detailed", "--disable-tqdm"]
        command += ["--result-dir", str(out_dir), "--result-filename", result.name]
        runs.append((subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), result))
    records = []
    for process, result in runs:
        _, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{err[-2000:]}")
        records += records_of(json.loads(result.read_text()))
    return records


def records_of(data: dict) -> list[dict]:
    """Per-request records from `vllm bench serve --save-detailed` output."""
    records = []
    for ttft, itl, start, latency, tokens, error in zip(
        data["ttfts"], data["itls"], data["start_times"], data["latencies"], data["output_lens"], data["errors"]
    ):
        # A gap per streamed chunk: a server that ends with a chunk of its own (finish
        # reason, no token; pdserve's HTTP front does) has one more than its tokens.
        gaps = itl[: max(tokens - 1, 0)]
        end = start + latency
        records.append({"ttft": ttft, "itl": gaps, "tokens": tokens, "start": start, "end": end, "error": error})
    return records


def judge(system: str, rate: float, records: list[dict], output_len: int, slo: SLO) -> RatePoint:
    """Records may come from several turns (`turn` in each record): the duration is the sum
    of each turn's own span."""
    done = [r for r in records if not r["error"] and r["tokens"] == output_len]
    good = [r for r in done if r["ttft"] <= slo.ttft_s and (not r["itl"] or percentile(r["itl"], 90) <= slo.itl_s)]
    turns: dict[int, list[dict]] = {}
    for r in records:
        turns.setdefault(r.get("turn", 0), []).append(r)
    duration = sum(max(r["end"] for r in turn) - min(r["start"] for r in turn) for turn in turns.values())
    return RatePoint(
        system,
        rate,
        len(records),
        len(done),
        LatencySummary.of([r["ttft"] for r in done]),
        LatencySummary.of([(r["end"] - r["start"] - r["ttft"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]),
        LatencySummary.of([g for r in done for g in r["itl"]]),
        len(good) / duration,
        len(good) / len(records),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def print_table(points: list[RatePoint], systems: list[str]) -> None:
    print("\n| rate | system | TTFT p50 / p99 ms | TPOT p50 ms | ITL p99 ms | goodput req/s | in SLO |")
    print("|---|---|---|---|---|---|---|")
    for p in points:
        print(
            f"| {p.rate:g} | {p.system} | {_ms(p.ttft_s.p50)} / {_ms(p.ttft_s.p99)} | {_ms(p.tpot_s.p50)} | "
            f"{_ms(p.itl_s.p99)} | {p.goodput_rps:.2f} | {100 * p.slo_attainment:.0f}% |"
        )
    base = systems[0]
    print(f"\nratios against {base} (goodput; TPOT p50):")
    for rate in sorted({p.rate for p in points}):
        row = {p.system: p for p in points if p.rate == rate}
        if base not in row:
            continue
        cells = []
        for name in systems[1:]:
            if name in row:
                b, o = row[base], row[name]
                good = o.goodput_rps / b.goodput_rps if b.goodput_rps else float("nan")
                tpot = o.tpot_s.p50 / b.tpot_s.p50 if o.tpot_s.p50 and b.tpot_s.p50 else float("nan")
                cells.append(f"{name}: {good:.2f}x goodput, {tpot:.2f}x TPOT")
        print(f"  {rate:g} req/s: " + "; ".join(cells))


def plot(points: list[RatePoint], systems: list[str], path: Path) -> None:
    """TPOT p50 and goodput against the offered rate, a line per system."""
    from bench.loadgen import _pyplot

    plt = _pyplot()
    fig, (tpot, goodput) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in systems:
        mine = sorted((p for p in points if p.system == name), key=lambda p: p.rate)
        rates = [p.rate for p in mine]
        tpot.plot(rates, [1e3 * (p.tpot_s.p50 or float("nan")) for p in mine], marker="o", label=name)
        goodput.plot(rates, [p.goodput_rps for p in mine], marker="o", label=name)
    tpot.set(xlabel="offered load, req/s", ylabel="TPOT p50, ms", title="time per output token")
    goodput.set(xlabel="offered load, req/s", ylabel="requests in SLO / s", title="goodput")
    tpot.set_ylim(bottom=0)
    goodput.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vs_vllm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--rates", type=float, nargs="+", default=[1, 3, 5, 7])
    parser.add_argument("--requests", type=int, default=40, help="per rate, system and round")
    parser.add_argument("--rounds", type=int, default=2, help="turns of every system at every rate")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=256 << 20, help="stock servers' KV cache (pdserve's CPU default)"
    )
    parser.add_argument(
        "--pdserve-eager", action="store_true", help="pdserve's CPU default (eager) instead of compiled like stock vLLM"
    )
    parser.add_argument(
        "--pdserve-engine-path",
        choices=["auto", "inprocess", "async"],
        default="auto",
        help="pdserve's engine path (auto: in-process LLMEngine on CPU; "
        "async: vLLM's AsyncLLM, engine core in its own process)",
    )
    parser.add_argument(
        "--pdserve-flags", default="", help='more `pdserve serve` flags, e.g. "--max-num-batched-tokens 2048"'
    )
    systems = ["stock", "colocated", "1p1d"]
    parser.add_argument("--systems", nargs="+", default=systems, choices=systems)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="also run each pdserve system from this checkout (e.g. `git worktree add /tmp/base HEAD~1`); "
        "without stock, ratios are against it",
    )
    parser.add_argument("--json", type=Path, help="write every rate point here")
    parser.add_argument(
        "--plot", type=Path, default=Path("bench/results/vs_vllm.png"), help="TPOT and goodput per rate"
    )
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    cores = sorted(os.sched_getaffinity(0))[:2]

    def pdserve_system(prefill: int, decode: int, tree: Path | None = None) -> _System:
        return pdserve(
            args.model, prefill, decode, args.pdserve_eager, args.pdserve_engine_path, args.pdserve_flags, tree
        )

    builders = {
        "stock": lambda: stock_vllm(model, cores, args.kv_cache_bytes),
        "colocated": lambda: pdserve_system(0, 2),
        "1p1d": lambda: pdserve_system(1, 1),
    }
    runs = [builders[key] for key in args.systems]
    if args.baseline_tree:  # each pdserve system also with the other checkout's code, first
        baseline = {"colocated": lambda: pdserve_system(0, 2, args.baseline_tree)}
        baseline["1p1d"] = lambda: pdserve_system(1, 1, args.baseline_tree)
        stock = runs[:1] if args.systems[0] == "stock" else []
        runs = stock + [baseline[key] for key in args.systems if key in baseline] + runs[len(stock) :]
    records: dict[tuple[str, float], list[dict]] = {}
    names: list[str] = []
    turn = 0
    with tempfile.TemporaryDirectory(prefix="vs-vllm-") as out:
        for round_ in range(args.rounds):
            for build in runs if round_ % 2 == 0 else runs[::-1]:
                system = build()
                if system.name not in names:
                    names.append(system.name)
                try:
                    system.wait_ready(timeout_s=600)
                    warm = argparse.Namespace(**{**vars(args), "requests": len(cores)})
                    _bench(system.urls, model, 1.0, warm, Path(out), len(cores))
                    for rate in args.rates:
                        turn += 1
                        got = _bench(system.urls, model, rate, args, Path(out), len(cores))
                        records.setdefault((system.name, rate), []).extend({**r, "turn": turn} for r in got)
                        point = judge(system.name, rate, got, args.output_len, DEFAULT_SLO)
                        print(
                            f"round {round_ + 1}/{args.rounds}: {system.name} at {rate:g} req/s: "
                            f"goodput {point.goodput_rps:.2f} req/s, {100 * point.slo_attainment:.0f}% in SLO, "
                            f"TPOT p50 {_ms(point.tpot_s.p50)} ms",
                            file=sys.stderr,
                        )
                finally:
                    system.stop()
    points = [
        judge(name, rate, records[(name, rate)], args.output_len, DEFAULT_SLO) for rate in args.rates for name in names
    ]
    shape = f"{args.input_len}-token prompts, {args.output_len} output tokens, {args.requests} requests per rate"
    shape += f" and system in each of {args.rounds} rounds"
    print(f"\n{shape}, Poisson arrivals; SLO: TTFT <= {DEFAULT_SLO.ttft_s:g} s and a request's p90")
    print(f"inter-token gap <= {1e3 * DEFAULT_SLO.itl_s:g} ms")
    print_table(points, names)
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in points], indent=2))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(points, names, args.plot)
    print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
