"""Which listening sockets are Ray's own (tests check that pdserve's are no wider than needed)."""

from __future__ import annotations

# Ray's default worker port range: every Ray worker and driver runs a gRPC server there.
RAY_WORKER_PORTS = range(10002, 20000)
RAY_DAEMONS = (
    "gcs_server",
    "raylet",
    "ray::DashboardAgent",
    "dashboard/agent.py",
    "dashboard/dashboard.py",
    "_private/monitor.py",
)


def is_rays_own(port: int, command: str) -> bool:
    """Ray 2.60's servers that bind every interface, with no setting to narrow them: its
    daemons (GCS, raylet, dashboard agent, dashboard and autoscaler metrics) and the gRPC
    server of each Ray worker and driver, in the worker port range on any process, pdserve's
    own included. (Upstream Ray binds them to the node address since ray-project/ray#59852.)"""
    return port in RAY_WORKER_PORTS or any(daemon in command for daemon in RAY_DAEMONS)
