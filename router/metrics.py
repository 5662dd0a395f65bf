"""Prometheus metrics of the router: per-request phase latencies by prompt-length bucket,
and per-actor pool gauges. Every latency a user needs is here, not in logs."""

from __future__ import annotations

import bisect
import itertools
import threading
from typing import Iterator, Sequence

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from cluster.pools import Pool
from router.binding import bind_error

PROMPT_BUCKETS = ((128, "0-127"), (512, "128-511"), (2048, "512-2047"), (8192, "2048-8191"))
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 50000)

_L = ["prompt_bucket"]
QUEUE = Histogram("pdserve_queue_seconds", "Router arrival to prefill start", _L, buckets=_SECONDS)
PREFILL = Histogram("pdserve_prefill_seconds", "Prefill engine time", _L, buckets=_SECONDS)
PROMPT_RATE = Histogram("pdserve_prefill_tokens_per_second", "Prompt tokens per second of prefill", _L, buckets=_RATE)
TRANSFER = Histogram(
    "pdserve_transfer_seconds", "Prefill done to decode's first token (NIXL pull + one step)", _L, buckets=_SECONDS
)
TTFT = Histogram("pdserve_ttft_seconds", "Time to first token at the router", _L, buckets=_SECONDS)


class GapHistogram:
    """A Prometheus histogram observed a whole request's values at once.

    prometheus_client's Histogram takes one value per call, each with a label lookup and a
    lock: too dear once per streamed token (the inter-token gaps) on the router's request
    path. This keeps plain counts per label and bucket, updated under one lock per request,
    and exports them through a collector in the same exposition format."""

    def __init__(self, name: str, documentation: str, label: str, buckets: Sequence[float]) -> None:
        self._name, self._documentation, self._label = name, documentation, label
        self._bounds = (*buckets, float("inf"))
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()  # the metrics endpoint reads from its own thread
        REGISTRY.register(self)

    def observe_all(self, label: str, values: Sequence[float]) -> None:
        bounds = self._bounds
        with self._lock:
            counts = self._counts.setdefault(label, [0] * len(bounds))
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket with value <= le
            self._sums[label] = self._sums.get(label, 0.0) + sum(values)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=[self._label])
        with self._lock:
            snapshot = [(label, list(counts), self._sums[label]) for label, counts in self._counts.items()]
        for label, counts, total in snapshot:
            cumulative = itertools.accumulate(counts)
            buckets = [(floatToGoString(bound), count) for bound, count in zip(self._bounds, cumulative)]
            family.add_metric([label], buckets, total)
        yield family


ITL = GapHistogram("pdserve_inter_token_seconds", "Gap between consecutive output tokens", _L[0], _SECONDS)
E2E = Histogram("pdserve_e2e_seconds", "Request arrival to last token", _L, buckets=_SECONDS)
OUTPUT_RATE = Histogram("pdserve_output_tokens_per_second", "Decode tokens per second per request", _L, buckets=_RATE)
TRANSFER_BYTES = Counter("pdserve_request_transfer_bytes_total", "State bytes moved for requests", ["kind"])
REQUESTS = Counter("pdserve_requests_total", "Finished requests by outcome", ["outcome"])
MIGRATIONS = Counter("pdserve_migrations_total", "Streams resumed on another decode actor")
LOCAL_PREFILL_FALLBACKS = Counter(
    "pdserve_local_prefill_fallbacks_total", "Requests prefilled on a decode engine because no prefill actor was live"
)
PREFILL_PLANS = Counter(
    "pdserve_prefill_plans_total", "Where each leg's prompt was prefilled: the plan's reason", ["reason"]
)
ROUTES = Counter("pdserve_route_picks_total", "Engines picked for a leg, by pool and why", ["pool", "reason"])
FAILOVERS = Counter("pdserve_decode_failovers_total", "Streams whose decode actor died, by what was done", ["action"])
HANDOFF_RETRIES = Counter(
    "pdserve_handoff_retries_total", "Requests prefilled again because decode could not load the handed-off state"
)
SHADOW_CHECKS = Counter(
    "pdserve_shadow_checks_total",
    "Requests recomputed colocated to check P/D's tokens (router/shadow_verification.py), by outcome: "
    "agree, diverge, error (could not run), skipped (checks busy)",
    ["outcome"],
)
PROMPT_TOKENS = Counter("pdserve_request_prompt_tokens_total", "Prompt tokens of finished requests")
CACHED_TOKENS = Counter(
    "pdserve_request_cached_tokens_total", "Prompt tokens of finished requests served from a prefix cache"
)
DRAFT_TOKENS = Counter(
    "pdserve_draft_tokens_total", "Speculative decoding's draft tokens of finished requests, by outcome", ["outcome"]
)
PREDICTED_CACHED_TOKENS = Counter(
    "pdserve_predicted_cached_tokens_total",
    "Prompt tokens the picked prefill engine held, by this router's copy of its prefix index",
)
PREFIX_PREDICTIONS = Counter(
    "pdserve_prefix_predictions_total",
    "Requests routed by prefix, by how the copy of their first engine's prefix index compared with the cached "
    "tokens the engine then reported: within 5%, over, under",
    ["outcome"],
)
PREFIX_COPIES_UNREADY = Counter(
    "pdserve_prefix_copies_unready_total",
    "Engines counted as holding nothing of a prompt because this router's copy of their prefix index was "
    "still starting",
)
PREFIX_LOOKUP = Histogram(
    "pdserve_prefix_lookup_seconds",
    "Time a request took to find what its pool's engines hold of its prompt (hashing it, reading the copies)",
    ["pool"],
    buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
)

_A = ["role", "actor"]
RUNNING = Gauge("pdserve_actor_running_requests", "Requests running in the actor's engine", _A)
WAITING = Gauge("pdserve_actor_waiting_requests", "Requests queued (incl. waiting for remote KV)", _A)
HELD = Gauge("pdserve_actor_leases_held", "Finished requests whose blocks wait for a decode read", _A)
BLOCKS_USED = Gauge(
    "pdserve_actor_kv_blocks_used",
    "KV-cache blocks in use: attention blocks and DeltaNet state slots share the pool",
    _A,
)
BLOCKS_TOTAL = Gauge("pdserve_actor_kv_blocks_total", "KV-cache blocks in the actor's pool", _A)
ALIVE = Gauge("pdserve_actor_alive", "1 while the actor answers and takes traffic", _A)


def prompt_bucket(prompt_tokens: int) -> str:
    return next((name for limit, name in PROMPT_BUCKETS if prompt_tokens < limit), f"{PROMPT_BUCKETS[-1][0]}+")


def observe_prediction(predicted: int, cached: int) -> None:
    """One request's predicted against actual prefix-cache hit (the issue's target: within 5%)."""
    outcome = "within 5%" if abs(predicted - cached) <= 0.05 * cached else "over" if predicted > cached else "under"
    PREFIX_PREDICTIONS.labels(outcome).inc()


def observe_request(result, token_gaps: list[float]) -> None:  # noqa: ANN001 (orchestrator.GenerationResult)
    bucket = prompt_bucket(result.prompt_tokens)
    t = result.timings
    for histogram, value in ((QUEUE, t.queue_s), (TTFT, t.ttft_s), (E2E, t.e2e_s)):
        histogram.labels(bucket).observe(value)
    if t.prefill_s > 0:
        PREFILL.labels(bucket).observe(t.prefill_s)
        PROMPT_RATE.labels(bucket).observe(result.prompt_tokens / t.prefill_s)
    if t.transfer_s > 0:  # not when prefill's first token ended the request
        TRANSFER.labels(bucket).observe(t.transfer_s)
    if t.decode_tokens_per_s > 0:
        OUTPUT_RATE.labels(bucket).observe(t.decode_tokens_per_s)
    ITL.observe_all(bucket, token_gaps)
    TRANSFER_BYTES.labels("attention_kv").inc(t.transfer_bytes.attention_kv)
    TRANSFER_BYTES.labels("deltanet_state").inc(t.transfer_bytes.deltanet_state)
    REQUESTS.labels(result.finish_reason).inc()
    MIGRATIONS.inc(result.migrations)
    PROMPT_TOKENS.inc(result.prompt_tokens)
    CACHED_TOKENS.inc(result.cached_tokens)
    if result.draft_tokens:
        DRAFT_TOKENS.labels("accepted").inc(result.accepted_draft_tokens)
        DRAFT_TOKENS.labels("rejected").inc(result.draft_tokens - result.accepted_draft_tokens)


def observe_pool(pool: Pool) -> None:
    for member in pool.members:
        labels = (pool.role, member.name)
        ALIVE.labels(*labels).set(1 if member.live else 0)
        if member.load is None:
            continue
        RUNNING.labels(*labels).set(member.load.running)
        WAITING.labels(*labels).set(member.load.waiting)
        HELD.labels(*labels).set(member.load.held_for_transfer)
        BLOCKS_USED.labels(*labels).set(member.load.total_blocks - member.load.free_blocks)
        BLOCKS_TOTAL.labels(*labels).set(member.load.total_blocks)


def serve_metrics(host: str, port: int) -> str:
    """Serve this process's metrics over HTTP at `host`:`port`; the address it listens on."""
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host)
    except OSError as err:  # the bare error names no address
        raise bind_error("metrics", host, port, err) from None
    return f"{host}:{server.server_port}"
