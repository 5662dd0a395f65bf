"""The router's batch-observed inter-token histogram exports exactly what prometheus_client's
own Histogram does for the same values (bucket edges included: a value equal to a bound
counts in that bucket); a taken port is named."""

import socket

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest


def test_gap_histogram_matches_prometheus_histogram():
    from prometheus_client import REGISTRY

    from router import metrics

    registry = CollectorRegistry()
    reference = Histogram("ref_seconds", "x", ["prompt_bucket"], buckets=metrics._SECONDS, registry=registry)
    values = [0.0, 0.0005, 0.001, 0.0011, 0.05, 0.05, 0.3, 30.0, 100.0]
    for value in values:
        reference.labels("test-bucket").observe(value)
    metrics.ITL.observe_all("test-bucket", values)

    def lines(text: str, name: str) -> list[str]:
        return [
            line.replace(name, "NAME")
            for line in text.splitlines()
            if line.startswith(name) and "test-bucket" in line and "_created" not in line
        ]

    ours = lines(generate_latest(REGISTRY).decode(), "pdserve_inter_token_seconds")
    theirs = lines(generate_latest(registry).decode(), "ref_seconds")
    assert len(ours) == len(metrics._SECONDS) + 3  # every bucket, +Inf, count, sum
    assert ours == theirs


def test_a_taken_port_is_named_for_the_metrics_endpoint_and_both_fronts():
    """`pdserve serve` prints these: the bare OSError (gRPC's RuntimeError) names no address
    (no cause)."""
    import grpc

    from router.metrics import serve_metrics
    from router.openai_http import _reusable_socket
    from router.server import bind_port

    with socket.socket() as taken:  # no SO_REUSEPORT: nobody may share it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"metrics 127.0.0.1:{port}: .*pick another"):
            serve_metrics("127.0.0.1", port)
        with pytest.raises(OSError, match=rf"HTTP front 127.0.0.1:{port}: .*pick another"):
            _reusable_socket("127.0.0.1", port)
        with pytest.raises(OSError, match=rf"gRPC front 127.0.0.1:{port}: Address already in use; free that"):
            bind_port(grpc.server(None), f"127.0.0.1:{port}", None)
