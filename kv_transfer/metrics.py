"""Prometheus metrics of the transfer layer, exported by each worker process.

Per-transfer duration, bytes, descriptor count and failures come from vLLM's NixlConnector
statistics (delivered each engine step to the engine's stat logger, vllm_engine.stat_logger); the split into
attention KV and DeltaNet state bytes comes from our handle accounting; leases are counted
by the prefill worker (granted) and by vLLM (expired).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from kv_transfer.digests import CHECKED, FAILED, UNCHECKED

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_BYTES = tuple(float(2**p) for p in range(12, 36, 2))  # 4 KiB .. 32 GiB

TRANSFER_SECONDS = Histogram(
    "pdserve_nixl_transfer_seconds", "Duration of one NIXL READ of a request's state", buckets=_SECONDS
)
TRANSFER_BYTES = Histogram("pdserve_nixl_transfer_bytes", "Bytes moved by one NIXL READ", buckets=_BYTES)
TRANSFER_BANDWIDTH = Histogram(
    "pdserve_nixl_transfer_bandwidth_bytes_per_second",
    "Achieved bandwidth of one NIXL READ",
    buckets=tuple(float(2**p) for p in range(24, 40)),  # 16 MiB/s .. 512 GiB/s
)
TRANSFER_DESCRIPTORS = Histogram(
    "pdserve_nixl_transfer_descriptors", "NIXL descriptors in one READ", buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384)
)
LINK_GBITS = Gauge(
    "pdserve_link_gbits", "Gbit/s of the start-up READ from a prefill to a decode engine", ["prefill", "decode"]
)
TRANSFER_FAILURES = Counter("pdserve_nixl_transfer_failures_total", "Failed transfers by cause", ["cause"])
STATE_BYTES = Counter("pdserve_transfer_state_bytes_total", "State bytes pulled by decode, by kind", ["kind"])
LEASES_GRANTED = Counter("pdserve_leases_granted_total", "Prefill results held for a decode read (one lease each)")
LEASES_EXPIRED = Counter("pdserve_leases_expired_total", "Leases that ran out before decode confirmed the read")
INTEGRITY_FAILURES = Counter(
    "pdserve_handoff_integrity_failures_total",
    "Pulled blocks or state slots whose transfer digest differed from the producer's (the load was discarded)",
    ["kind"],
)
DIGEST_CHECKS = Counter(
    "pdserve_handoff_digest_checks_total", "Handoffs carrying digests, by whether decode could check them", ["outcome"]
)

# vLLM NixlKVConnectorStats field -> our failure cause label.
_FAILURE_FIELDS = {
    "num_failed_transfers": "transfer",
    "num_failed_handshakes": "handshake",
    "num_failed_notifications": "notification",
    "num_notifications_after_expiry": "read_after_lease_expired",
}


def observe_connector_stats(data: dict[str, list[Any]]) -> None:
    """One step's NixlKVConnectorStats (scheduler_stats.kv_connector_stats) as our metrics."""
    for seconds, size, descriptors in zip(
        data.get("transfer_duration", []), data.get("bytes_transferred", []), data.get("num_descriptors", [])
    ):
        TRANSFER_SECONDS.observe(seconds)
        TRANSFER_BYTES.observe(size)
        TRANSFER_DESCRIPTORS.observe(descriptors)
        if seconds > 0:
            TRANSFER_BANDWIDTH.observe(size / seconds)
    for field, cause in _FAILURE_FIELDS.items():
        if data.get(field):
            TRANSFER_FAILURES.labels(cause).inc(len(data[field]))
    if data.get("num_kv_expired_reqs"):
        LEASES_EXPIRED.inc(len(data["num_kv_expired_reqs"]))
    # Every rank of a decode engine checks its share of a handoff: count each handoff once.
    for field, outcome in ((CHECKED, "checked"), (UNCHECKED, "unchecked")):
        DIGEST_CHECKS.labels(outcome).inc(_first_time(field, data.get(field, ())))
    for kind, field in FAILED.items():
        INTEGRITY_FAILURES.labels(kind).inc(_first_time(field, data.get(field, ())))


_SEEN: OrderedDict[tuple[str, str], None] = OrderedDict()


def _first_time(field: str, request_ids: Iterable[str]) -> int:
    """How many of `request_ids` this process has not yet counted under `field` (ranks report
    one handoff in the same step or the next; the last few thousand are remembered)."""
    new = 0
    for request_id in request_ids:
        if (field, request_id) not in _SEEN:
            _SEEN[(field, request_id)] = None
            new += 1
    while len(_SEEN) > 4096:
        _SEEN.popitem(last=False)
    return new


def serve_metrics(host: str) -> str:
    """Expose this process's metrics on a free port; returns the scrape address."""
    server, _ = start_http_server(0, addr=host)
    return f"{host}:{server.server_port}"
