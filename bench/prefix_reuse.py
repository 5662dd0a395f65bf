"""Prefix reuse on RAG traffic: pdserve routing by where prefixes are cached, against the same
build routing blind to them and with prefix caching off, side by side in one run on the same
cores.

The trace (seeded, the same for every system): `--documents` documents of `--document-tokens`
random token ids, drawn per request by Zipf popularity (`--zipf`), each followed by a fresh
`--question-tokens` question; `--output-tokens` out; Poisson arrivals at each `--rate`. One
system is up at a time (an idle engine still costs CPU here), each as `pdserve serve` runs it
behind the gRPC front: 2 prefill + 1 decode engines asking the prefill engines what they hold
(`--cache-aware`, the default) or not, and 1 prefill + 1 decode with caching off.

Reported per system and rate: TTFT p50/p90, ITL p90, goodput under the SLO, the share of
prompt tokens served from a prefix cache (the server's own count, per request), the bytes the
prefill engine's handle offered per request (decode pulls that less its own hits, which
pdserve_nixl_transfer_bytes on the decode engine counts); then each rate's TTFT p50 ratios,
cache-aware / cache-blind (issue target <= 0.4) and cache-aware / caching off. Plotted: TTFT
CDFs and goodput per rate beside the JSON.

    python -m bench.prefix_reuse [--rate 1 2] [--num-requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.loadgen import (
    TOKEN_ID_RANGE,
    RunReport,
    add_load_args,
    check_fits,
    format_row,
    load_config,
    plot_cdfs,
    plot_goodput,
    poisson_arrivals,
    run_workload,
    warm_up,
    write_json,
)
from cluster.ray_cluster import start_local
from configuration.parsers import parse_bytes
from controller.deployment import DeploymentConfig
from controller.local_stack import LocalStack
from planner.trace import RequestSpec
from router.orchestrator import RouterPolicy
from router.security import ClientCredentials
from vllm_engine.config import EngineConfig, resolve_model


@dataclass(frozen=True, slots=True)
class RagTrace:
    documents: int = 8
    document_tokens: int = 1536
    question_tokens: int = 128
    output_tokens: int = 50
    zipf: float = 1.1  # popularity of document k is proportional to 1 / k**zipf
    seed: int = 0

    def requests(self, rate: float, count: int) -> tuple[list[RequestSpec], list[list[int]]]:
        """The same documents and draws at every rate; only the arrivals stretch."""
        ids = random.Random(f"rag-documents-{self.seed}")
        documents = [
            [ids.randrange(*TOKEN_ID_RANGE) for _ in range(self.document_tokens)] for _ in range(self.documents)
        ]
        weights = [1 / (k + 1) ** self.zipf for k in range(self.documents)]
        draws = random.Random(f"rag-draws-{self.seed}")
        prompts = []
        for _ in range(count):
            document = draws.choices(documents, weights)[0]
            prompts.append(document + [draws.randrange(*TOKEN_ID_RANGE) for _ in range(self.question_tokens)])
        arrivals = poisson_arrivals(rate, count, random.Random(f"rag-arrivals-{self.seed}"))
        specs = [RequestSpec(i, t, len(p), self.output_tokens) for i, (t, p) in enumerate(zip(arrivals, prompts))]
        return specs, prompts


@dataclass(frozen=True, slots=True)
class Row:
    system: str
    rate: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    goodput_rps: float
    slo_attainment: float
    cached_share: float  # cached prompt tokens / prompt tokens, completed requests
    handle_bytes_per_request: float

    @classmethod
    def of(cls, system: str, report: RunReport) -> "Row":
        s = report.summary
        done = [r for r in report.requests if r.completed]
        prompt = sum(r.prompt_tokens for r in done)
        return cls(
            system=system,
            rate=report.rate or 0.0,
            ttft_p50_ms=_ms(s.ttft_s.p50),
            ttft_p90_ms=_ms(s.ttft_s.p90),
            itl_p90_ms=_ms(s.itl_s.p90),
            goodput_rps=s.goodput_rps,
            slo_attainment=s.slo_attainment,
            cached_share=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
            handle_bytes_per_request=sum(r.handle_bytes for r in done) / len(done) if done else 0.0,
        )

    def line(self) -> str:
        return (
            f"{self.system:<22} {self.rate:>5g} req/s"
            f" | TTFT p50/p90 {_fmt(self.ttft_p50_ms)}/{_fmt(self.ttft_p90_ms)} ms"
            f" | ITL p90 {_fmt(self.itl_p90_ms)} ms | goodput {self.goodput_rps:.2f} req/s ({self.slo_attainment:.0%})"
            f" | cached {self.cached_share:.0%} | handle {self.handle_bytes_per_request / 2**20:.2f} MiB/request"
        )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _ratio(a: RunReport, b: RunReport) -> float:
    return (a.summary.ttft_s.p50 or 0.0) / (b.summary.ttft_s.p50 or float("inf"))


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


@dataclass(frozen=True, slots=True)
class System:
    label: str
    prefill: int
    caching: bool
    cache_aware: bool

    def deployment(self, model: str, kv_cache_bytes: int | None) -> DeploymentConfig:
        engine = EngineConfig(model=model, enable_prefix_caching=self.caching, kv_cache_bytes=kv_cache_bytes)
        policy = RouterPolicy(cache_aware=self.cache_aware)
        return DeploymentConfig(engine=engine, num_prefill=self.prefill, policy=policy)


SYSTEMS = (
    System("2P+1D cache-aware", 2, caching=True, cache_aware=True),
    System("2P+1D cache-blind", 2, caching=True, cache_aware=False),
    System("1P+1D caching off", 1, caching=False, cache_aware=False),
)


async def run_system(
    model: str, system: System, trace: RagTrace, rates: list[float], args: argparse.Namespace
) -> list[RunReport]:
    config = load_config(args)
    async with LocalStack(system.deployment(model, args.kv_cache_bytes), text_prompts=False) as stack:
        async with ClientCredentials().channel(stack.server.address) as channel:
            specs, _ = trace.requests(1.0, config.num_requests)
            await check_fits(channel, specs)
            await warm_up(channel, config)
            reports = []
            for rate in rates:
                specs, prompts = trace.requests(rate, config.num_requests)
                label = f"{system.label} {rate:g} req/s"
                reports.append(await run_workload(channel, specs, config, label, rate, prompts=prompts))
                print(format_row(reports[-1]), file=sys.stderr, flush=True)
            return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rate", type=float, nargs="+", default=[1.0, 2.0], help="Poisson rates, req/s")
    defaults = RagTrace()
    parser.add_argument("--documents", type=int, default=defaults.documents)
    parser.add_argument("--document-tokens", type=int, default=defaults.document_tokens)
    parser.add_argument("--question-tokens", type=int, default=defaults.question_tokens)
    parser.add_argument("--output-tokens", type=int, default=defaults.output_tokens)
    parser.add_argument("--zipf", type=float, default=defaults.zipf)
    parser.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes,
        default=None,
        help="per engine, e.g. 48MiB: below the documents' size, routing decides which engine keeps which",
    )
    add_load_args(parser, num_requests=40, time_limit_s=90.0, out=Path("bench/results/prefix_reuse.json"))
    args = parser.parse_args(argv)
    trace = RagTrace(
        args.documents, args.document_tokens, args.question_tokens, args.output_tokens, args.zipf, args.seed
    )
    start_local()
    model = resolve_model(args.model)
    series: dict[str, list[RunReport]] = {}
    for system in SYSTEMS:
        print(f"== {system.label}", file=sys.stderr, flush=True)
        series[system.label] = asyncio.run(run_system(model, system, trace, args.rate, args))
    rows = [Row.of(name, report) for name, reports in series.items() for report in reports]
    write_json(args.out, {"trace": asdict(trace), "rows": [asdict(r) for r in rows]})
    plot_cdfs(series, args.out.with_name(f"{args.out.stem}_cdf.png"))
    plot_goodput(series, args.out.with_name(f"{args.out.stem}_goodput.png"))
    print(
        f"RAG: {trace.documents} documents of {trace.document_tokens} tokens (Zipf {trace.zipf}), "
        f"{trace.question_tokens}-token questions, {trace.output_tokens} tokens out"
    )
    for row in rows:
        print(row.line())
    aware, blind, off = (series[system.label] for system in SYSTEMS)
    for a, b, c in zip(aware, blind, off):
        print(
            f"{a.rate:g} req/s: TTFT p50 cache-aware / cache-blind {_ratio(a, b):.2f}x, / caching off "
            f"{_ratio(a, c):.2f}x; goodput cache-aware / cache-blind "
            f"{a.summary.goodput_rps / max(b.summary.goodput_rps, 1e-9):.2f}x"
        )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
