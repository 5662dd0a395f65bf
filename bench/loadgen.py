"""Open-loop load generator for the pdserve gRPC API (`pdserve.v1.Generation`), and (`sweep_http`)
for its OpenAI front.

Requests arrive on their own schedule whatever the server's state (open loop): Poisson
arrivals at `--rate` req/s (several rates: a sweep), or the arrival times of a JSONL trace,
one request per line: {"arrival_s": 0.25, "prompt_tokens": 1000, "output_tokens": 50}.
Prompts are random token ids in [1, 2000), seeded per request; every request is sent with
ignore_eos and max_tokens = its output length, so outputs have exactly the intended length.

Lengths (--profile): `default` about 20:1 prompt:generation (outputs 40-60 tokens, prompts
~1000); `rag` the RAG range measured on the cluster, 19:1 to 47:1 (outputs 40-60); `fixed`
3000 in / 150 out.

Reported per run: p50/p90/p99 of TTFT (send -> first token), ITL (every gap between
consecutive tokens as the client receives them; tokens in one message have a 0 s gap),
end-to-end latency; throughput (completed req/s, output tok/s); goodput: completed requests
per second that met both SLOs, TTFT <= --ttft-slo and per-request ITL <= --itl-slo, where a
request's ITL is the mean of its gaps, (last token - first token) / (tokens - 1) (DistServe's
TPOT; --itl-stat p90 uses the 90th percentile of its gaps instead). Latency percentiles are
over completed requests (every intended token received); failures count against goodput.

Bounded: each run sends at most --num-requests requests and ends after --time-limit seconds
(requests still streaming then are cancelled by their gRPC deadline); targets must be
loopback addresses.

    python -m bench.loadgen --target 127.0.0.1:50051 --rate 1 2 4 [--profile rag]
    python -m bench.loadgen --target 127.0.0.1:50051 --trace trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import math
import random
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import grpc
import httpx
from tqdm import tqdm

from messages.timings import SLO, ItlStat, LatencySummary, percentile
from planner.trace import RequestSpec, parse_trace
from proto.pdserve.v1 import generate_pb2 as pb
from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc
from configuration.flags import add_flags, build
from router.client import build_request, stream_generate
from router.security import ClientCredentials

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TOKEN_ID_RANGE = (1, 2000)  # [low, high): clear of the embedded model's special ids (vocab 2048)


@dataclass(frozen=True, slots=True)
class LengthProfile:
    """Output length uniform in `output_tokens`, prompt = output x a ratio uniform in `ratio`."""

    output_tokens: tuple[int, int]  # inclusive
    ratio: tuple[float, float]  # prompt:generation

    def sample(self, rng: random.Random) -> tuple[int, int]:
        output = rng.randint(*self.output_tokens)
        return max(1, round(rng.uniform(*self.ratio) * output)), output


PROFILES = {
    "default": LengthProfile((40, 60), (16.0, 24.0)),  # ~20:1, prompts 640-1440 (mean ~1000)
    "rag": LengthProfile((40, 60), (19.0, 47.0)),
    "fixed": LengthProfile((150, 150), (20.0, 20.0)),  # 3000 in / 150 out
}


# About 5x and 2.5x a lone ~1000-token request on this 2-core CPU box (TTFT 130-190 ms,
# 8-12 ms per token): bench/goodput_compare.py explains the choice.
DEFAULT_SLO = SLO(ttft_s=1.0, itl_s=0.025)


@dataclass(frozen=True, slots=True)
class LoadConfig:
    num_requests: int = 100
    time_limit_s: float = 120.0
    profile: LengthProfile = PROFILES["default"]
    seed: int = 0
    slo: SLO = DEFAULT_SLO
    warmup: int = 2  # serial requests before measuring (first NIXL handshake, allocator)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not 0 < self.time_limit_s < math.inf:
            raise ValueError("a run needs a positive request count and a finite positive time limit")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    prompt_tokens: int
    output_tokens: int  # intended
    arrival_s: float  # scheduled, from the start of the run
    sent_s: float  # actual; later than arrival_s only if the client fell behind
    token_times_s: tuple[float, ...]  # from send, one per token received
    end_s: float  # from send: the final message or the error
    finish_reason: str
    error: str  # gRPC status name; "" when the stream ended normally
    cached_tokens: int = 0  # prompt tokens the prefilling engine found in its prefix cache
    handle_bytes: int = 0  # attention KV + DeltaNet state the prefill engine offered decode
    text: str = ""  # the output's text (the OpenAI front only): a conversation sends it back

    @property
    def completed(self) -> bool:
        return not self.error and len(self.token_times_s) == self.output_tokens

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times_s)]

    def itl_s(self, stat: ItlStat) -> float | None:
        """None for a single-token output (nothing to be late for)."""
        gaps = self.gaps_s
        if not gaps:
            return None
        return sum(gaps) / len(gaps) if stat == "mean" else percentile(gaps, 90)

    def meets(self, slo: SLO) -> bool:
        itl = self.itl_s(slo.itl_stat)
        return self.completed and self.token_times_s[0] <= slo.ttft_s and (itl is None or itl <= slo.itl_s)


@dataclass(frozen=True, slots=True)
class Summary:
    sent: int
    completed: int
    duration_s: float  # first send -> last request done
    throughput_rps: float
    output_tokens_per_s: float
    ttft_s: LatencySummary
    itl_s: LatencySummary  # every token gap of every completed request
    request_itl_s: LatencySummary  # one value per request, the SLO's statistic
    e2e_s: LatencySummary
    good: int
    goodput_rps: float
    slo_attainment: float  # good / sent


@dataclass(frozen=True, slots=True)
class RunReport:
    label: str
    rate: float | None  # offered Poisson rate; None for a trace
    slo: SLO
    summary: Summary
    requests: list[RequestRecord]


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Arrival offsets of a Poisson process at `rate` conditioned on `count` arrivals in
    [0, count / rate]: sorted uniforms on that window (the same process, exponential gaps).
    Summing exponential gaps instead would let the realized rate of a short run drift by
    ~1/sqrt(count) from the nominal one, and the rates of a sweep would not be the rates
    offered."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    window = count / rate
    return sorted(rng.uniform(0.0, window) for _ in range(count))


def synthetic_workload(rate: float, count: int, profile: LengthProfile, seed: int) -> list[RequestSpec]:
    # Separate streams: the same seed gives the same lengths at every rate, only the
    # arrivals stretch or shrink, so runs at different rates (and systems) stay comparable.
    arrivals = poisson_arrivals(rate, count, random.Random(f"arrivals-{seed}"))
    lengths = random.Random(f"lengths-{seed}")
    return [RequestSpec(i, t, *profile.sample(lengths)) for i, t in enumerate(arrivals)]


def prompt_ids(spec: RequestSpec, seed: int) -> list[int]:
    # Seeded by (seed, index), not by position in a shared stream: a request's prompt is
    # the same whichever requests come before it.
    rng = random.Random(f"prompt-{seed}-{spec.index}")
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(spec.prompt_tokens)]


def require_loopback(target: str) -> None:
    host = target.rsplit(":", 1)[0].strip("[]")
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not addresses or not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise ValueError(f"target {target!r} is not a loopback address")


def summarize(records: Sequence[RequestRecord], slo: SLO) -> Summary:
    done = [r for r in records if r.completed]
    good = sum(r.meets(slo) for r in records)
    starts = [r.sent_s for r in records]
    duration = max((r.sent_s + r.end_s for r in records), default=0.0) - min(starts, default=0.0)
    per_s = 1 / duration if duration > 0 else 0.0
    request_itls = [itl for r in done if (itl := r.itl_s(slo.itl_stat)) is not None]
    return Summary(
        sent=len(records),
        completed=len(done),
        duration_s=duration,
        throughput_rps=len(done) * per_s,
        output_tokens_per_s=sum(len(r.token_times_s) for r in records) * per_s,
        ttft_s=LatencySummary.of([r.token_times_s[0] for r in done]),
        itl_s=LatencySummary.of([g for r in done for g in r.gaps_s]),
        request_itl_s=LatencySummary.of(request_itls),
        e2e_s=LatencySummary.of([r.end_s for r in done]),
        good=good,
        goodput_rps=good * per_s,
        slo_attainment=good / len(records) if records else 0.0,
    )


async def _send(
    channel: grpc.aio.Channel,
    spec: RequestSpec,
    prompt: list[int],
    run_id: str,
    started: float,
    deadline: float,
    metadata: tuple[tuple[str, str], ...] = (),
) -> RequestRecord:
    request = build_request(prompt, f"{run_id}-{spec.index}", max_tokens=spec.output_tokens, ignore_eos=True)
    sent = time.perf_counter()
    times: list[float] = []
    finish, error, final = "", "", None
    try:
        async for response in stream_generate(channel, request, max(deadline - sent, 1e-3), metadata):
            if response.HasField("chunk"):
                times.extend([time.perf_counter() - sent] * len(response.chunk.token_ids))
            else:
                final = response.final
                finish = final.finish_reason
    except grpc.aio.AioRpcError as err:
        error = err.code().name
    end = time.perf_counter() - sent
    return RequestRecord(
        spec.index,
        spec.prompt_tokens,
        spec.output_tokens,
        spec.arrival_s,
        sent - started,
        tuple(times),
        end,
        finish,
        error,
        final.usage.cached_tokens if final else 0,
        final.timings.attention_kv_bytes + final.timings.deltanet_state_bytes if final else 0,
    )


# The gRPC status an OpenAI-front refusal stands for, so both fronts' records read alike.
HTTP_STATUS_NAMES = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 400: "INVALID_ARGUMENT"}


def load_client() -> httpx.AsyncClient:
    """The HTTP client a load runs through: connections without bound, each dropped after 2 s
    idle. uvicorn (pdserve's OpenAI front, vLLM's server) closes a connection idle for 5 s,
    httpx's own default expiry: a request sent on a connection as the server closes it fails
    with ReadError, an error of the client's making (docs/benchmarks.md, prefix reuse)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    return httpx.AsyncClient(limits=limits)


@dataclass(frozen=True)
class HTTPTarget:
    """The OpenAI front: requests go to `base_url`/v1/completions, streamed, as `model`."""

    client: httpx.AsyncClient
    base_url: str
    model: str


async def _send_http(
    target: HTTPTarget, spec: RequestSpec, prompt: list[int] | str, run_id: str, started: float, deadline: float
) -> RequestRecord:
    """As `_send`, through any OpenAI-compatible server; logprobs 0 makes each event say how
    many tokens it carries (its text may hold fewer characters than tokens). Cached prompt
    tokens come from the final usage (`prompt_tokens_details`)."""
    body = {"model": target.model, "prompt": prompt, "max_tokens": spec.output_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
            "request_id": f"{run_id}-{spec.index}"}  # fmt: skip
    sent = time.perf_counter()
    times: list[float] = []
    finish, error, cached, text = "", "", 0, []
    try:
        timeout = httpx.Timeout(max(deadline - sent, 1e-3))
        async with target.client.stream("POST", f"{target.base_url}/v1/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                error = HTTP_STATUS_NAMES.get(r.status_code, f"HTTP {r.status_code}")
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    for choice in event["choices"]:
                        tokens = len((choice.get("logprobs") or {}).get("tokens", ()))
                        times.extend([time.perf_counter() - sent] * tokens)
                        text.append(choice.get("text") or "")
                        finish = choice["finish_reason"] or finish
                    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
                    cached = details.get("cached_tokens") or cached
    except httpx.TimeoutException:
        error = "DEADLINE_EXCEEDED"
    except httpx.TransportError as err:
        error = type(err).__name__
    end = time.perf_counter() - sent
    return RequestRecord(
        spec.index, spec.prompt_tokens, spec.output_tokens, spec.arrival_s, sent - started, tuple(times), end,
        finish, error, cached, text="".join(text),
    )  # fmt: skip


async def run_workload(
    channel: grpc.aio.Channel | Sequence[grpc.aio.Channel] | HTTPTarget,
    specs: Sequence[RequestSpec],
    config: LoadConfig,
    label: str,
    rate: float | None,
    metadata: tuple[tuple[str, str], ...] = (),
    prompts: Sequence[list[int]] | None = None,
) -> RunReport:
    """`channel`: one connection, or several that requests take in turn (routers sharing a
    port with SO_REUSEPORT are balanced per connection, so one connection reaches one), or
    the OpenAI front. `prompts`: one per spec (None: random ids, `prompt_ids`)."""
    channels = [channel] if isinstance(channel, (grpc.aio.Channel, HTTPTarget)) else list(channel)
    specs = specs[: config.num_requests]
    if prompts is None:  # built before the clock starts
        prompts = [prompt_ids(s, config.seed) for s in specs]
    run_id = f"lg-{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    deadline = started + config.time_limit_s
    tasks: list[asyncio.Task[RequestRecord]] = []
    with tqdm(total=len(specs), desc=label, unit="req", file=sys.stderr, disable=not config.progress) as bar:
        for i, (spec, prompt) in enumerate(zip(specs, prompts)):
            if spec.arrival_s >= config.time_limit_s:
                break
            await asyncio.sleep(started + spec.arrival_s - time.perf_counter())
            connection = channels[i % len(channels)]
            if isinstance(connection, HTTPTarget):
                sending = _send_http(connection, spec, prompt, run_id, started, deadline)
            else:
                sending = _send(connection, spec, prompt, run_id, started, deadline, metadata)
            task = asyncio.create_task(sending)
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
    return RunReport(label, rate, config.slo, summarize(records, config.slo), records)


async def check_fits(
    channel: grpc.aio.Channel, specs: Sequence[RequestSpec], metadata: tuple[tuple[str, str], ...] = ()
) -> None:
    """Fail before sending anything if the model cannot take these requests."""
    info = await pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata or None)
    longest = max(s.prompt_tokens + s.output_tokens for s in specs)
    if longest > info.max_model_len or TOKEN_ID_RANGE[1] > info.vocab_size:
        raise ValueError(
            f"model {info.model} (max_model_len {info.max_model_len}, vocab {info.vocab_size}) cannot take "
            f"{longest} tokens per request with ids below {TOKEN_ID_RANGE[1]}"
        )


async def warm_up(
    channel: grpc.aio.Channel | HTTPTarget,
    config: LoadConfig,
    metadata: tuple[tuple[str, str], ...] = (),
    requests: Sequence[tuple[RequestSpec, list[int] | str]] | None = None,
) -> None:
    """Serial unmeasured requests, of the profile's shape or `requests` (specs with their
    prompts, as `run_workload` takes them); a server that fails them stops the run."""
    quiet = replace(config, seed=-1 - config.seed, progress=False)  # a seed no measured run uses
    if requests is None:
        specs = synthetic_workload(1.0, config.warmup, config.profile, quiet.seed)
        requests = [(spec, prompt_ids(spec, quiet.seed)) for spec in specs]
    for spec, prompt in requests:
        report = await run_workload(channel, [replace(spec, arrival_s=0.0)], quiet, "warm-up", None, metadata, [prompt])
        if not report.summary.completed:
            raise RuntimeError(f"warm-up request failed: {report.requests[0].error or 'short output'}")


async def sweep(
    target: str,
    rates: Sequence[float],
    config: LoadConfig,
    label: str = "",
    credentials: ClientCredentials = ClientCredentials(),
) -> list[RunReport]:
    """One Poisson run per rate, in order, on one channel; the same requests at every rate."""
    require_loopback(target)
    metadata = credentials.metadata()
    async with credentials.channel(target) as channel:
        await check_fits(channel, synthetic_workload(1.0, config.num_requests, config.profile, config.seed), metadata)
        await warm_up(channel, config, metadata)
        reports = []
        for rate in rates:
            specs = synthetic_workload(rate, config.num_requests, config.profile, config.seed)
            reports.append(await run_workload(channel, specs, config, f"{label}{rate:g} req/s", rate, metadata))
            print(format_row(reports[-1]), file=sys.stderr, flush=True)
        return reports


async def sweep_http(base_url: str, rates: Sequence[float], config: LoadConfig, label: str = "") -> list[RunReport]:
    """`sweep` through the OpenAI front at `base_url` (http://HOST:PORT, loopback only)."""
    require_loopback(base_url.removeprefix("http://"))
    async with load_client() as client:
        models = (await client.get(f"{base_url}/v1/models", timeout=30)).json()["data"]
        target = HTTPTarget(client, base_url, models[0]["id"])
        await warm_up(target, config)
        reports = []
        for rate in rates:
            specs = synthetic_workload(rate, config.num_requests, config.profile, config.seed)
            reports.append(await run_workload(target, specs, config, f"{label}{rate:g} req/s", rate))
            print(format_row(reports[-1]), file=sys.stderr, flush=True)
        return reports


async def replay(
    target: str, specs: Sequence[RequestSpec], config: LoadConfig, credentials: ClientCredentials = ClientCredentials()
) -> RunReport:
    require_loopback(target)
    metadata = credentials.metadata()
    async with credentials.channel(target) as channel:
        await check_fits(channel, specs, metadata)
        await warm_up(channel, config, metadata)
        return await run_workload(channel, specs, config, "trace", None, metadata)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def format_row(report: RunReport) -> str:
    s = report.summary
    return (
        f"{report.label:>16} | sent {s.sent:>4} done {s.completed:>4} | "
        f"TTFT p50/p90/p99 {_ms(s.ttft_s.p50)}/{_ms(s.ttft_s.p90)}/{_ms(s.ttft_s.p99)} ms | "
        f"ITL {_ms(s.itl_s.p50)}/{_ms(s.itl_s.p90)}/{_ms(s.itl_s.p99)} ms | "
        f"E2E {_ms(s.e2e_s.p50)}/{_ms(s.e2e_s.p90)}/{_ms(s.e2e_s.p99)} ms | "
        f"{s.throughput_rps:.2f} req/s {s.output_tokens_per_s:.0f} tok/s | "
        f"goodput {s.goodput_rps:.2f} req/s ({s.slo_attainment:.0%} within SLO)"
    ) + _not_done(report.requests)


def _not_done(records: Sequence[RequestRecord]) -> str:
    """Why requests did not complete, by error (or how many of their tokens came)."""
    why = Counter(r.error or f"{len(r.token_times_s)} of {r.output_tokens} tokens" for r in records if not r.completed)
    return "".join(f" | not done: {n} {reason}" for reason, n in why.most_common())


def write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))


def _pyplot() -> ModuleType:
    """matplotlib, imported only when plotting, drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_cdfs(series: dict[str, Sequence[RunReport]], path: Path) -> None:
    """TTFT, inter-token gap and end-to-end CDFs of completed requests: one colour per series
    (system), one line style per run in it (rate), so equal rates share a style."""
    plt = _pyplot()
    metrics = {
        "TTFT": lambda r: [q.token_times_s[0] for q in r.requests if q.completed],
        "inter-token gap": lambda r: [g for q in r.requests if q.completed for g in q.gaps_s],
        "end-to-end latency": lambda r: [q.end_s for q in r.requests if q.completed],
    }
    fig, axes = plt.subplots(1, len(metrics), figsize=(15, 4.5))
    for ax, (name, values_of) in zip(axes, metrics.items()):
        for colour, runs in enumerate(series.values()):
            for style, run in zip(itertools.cycle(("-", "--", ":", "-.")), runs):
                values = sorted(values_of(run))
                fractions = [(i + 1) / len(values) for i in range(len(values))]
                ax.plot(values, fractions, linestyle=style, color=f"C{colour % 10}", label=run.label)
        ax.set(title=f"{name} CDF", xlabel="seconds (log)", ylabel="fraction")
        ax.set_xscale("log", nonpositive="mask")  # 0 s gaps: tokens that arrived in one message
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _save(fig, path)


def plot_goodput(series: dict[str, Sequence[RunReport]], path: Path) -> None:
    """Goodput and SLO attainment against offered rate, one line per series (system)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = max(r.rate or 0.0 for runs in series.values() for r in runs)
    left.plot([0, top], [0, top], color="grey", linestyle=":", label="offered")
    for name, runs in series.items():
        rates = [r.rate for r in runs]
        left.plot(rates, [r.summary.goodput_rps for r in runs], marker="o", label=name)
        right.plot(rates, [r.summary.slo_attainment for r in runs], marker="o", label=name)
    right.axhline(0.9, color="grey", linestyle=":", label="90%")
    slo = next(iter(series.values()))[0].slo
    left.set(
        title=f"goodput (TTFT <= {slo.ttft_s:g} s, ITL {slo.itl_stat} <= {slo.itl_s * 1e3:g} ms)",
        xlabel="offered rate (req/s)",
        ylabel="requests/s meeting both SLOs",
    )
    right.set(title="SLO attainment", xlabel="offered rate (req/s)", ylabel="fraction of requests", ylim=(0, 1.05))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    _save(fig, path)


def add_load_args(parser: argparse.ArgumentParser, num_requests: int, time_limit_s: float, out: Path) -> None:
    """Options shared by every command that runs this load generator."""
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default", help="length distribution")
    parser.add_argument("--num-requests", type=int, default=num_requests, help="per run (a trace is cut to this many)")
    parser.add_argument("--time-limit", type=float, default=time_limit_s, help="seconds per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo", type=float, default=DEFAULT_SLO.ttft_s, help="seconds")
    parser.add_argument("--itl-slo", type=float, default=DEFAULT_SLO.itl_s, help="seconds")
    parser.add_argument("--itl-stat", choices=["mean", "p90"], default="mean", help="per-request ITL statistic")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured serial requests first")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", type=Path, default=out, help="JSON results; PNG plots beside it")


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        num_requests=args.num_requests,
        time_limit_s=args.time_limit,
        profile=PROFILES[args.profile],
        seed=args.seed,
        slo=SLO(args.ttft_slo, args.itl_slo, itl_stat=args.itl_stat),
        warmup=args.warmup,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HOST:PORT of a pdserve gRPC server (loopback only)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--rate", type=float, nargs="+", help="Poisson arrival rate(s), req/s; several: a sweep")
    source.add_argument("--trace", type=Path, help="JSONL trace: arrival_s, prompt_tokens, output_tokens per line")
    add_load_args(parser, num_requests=100, time_limit_s=120.0, out=Path("bench/results/loadgen.json"))
    add_flags(parser, ClientCredentials)
    args = parser.parse_args(argv)
    config = load_config(args)
    credentials = build(ClientCredentials, args)
    if args.trace:
        specs = parse_trace(args.trace.read_text().splitlines())
        reports = [asyncio.run(replay(args.target, specs, config, credentials))]
    else:
        reports = asyncio.run(sweep(args.target, args.rate, config, credentials=credentials))
    write_json(args.out, [asdict(r) for r in reports])
    plot_cdfs({args.target: reports}, args.out.with_name(f"{args.out.stem}_cdf.png"))
    if len(reports) > 1:
        plot_goodput({args.target: reports}, args.out.with_name(f"{args.out.stem}_goodput.png"))
    for report in reports:
        print(format_row(report))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
