"""Which listening sockets are Ray's own (tests check that pdserve's are no wider than needed).

Ray 2.60 binds its servers to every interface, with no setting to narrow them (upstream Ray
binds them to the node address since ray-project/ray#59852): its daemons (GCS, raylet,
dashboard agent, dashboard and autoscaler metrics), and in every other Ray process (a driver,
an actor: pdserve's own processes) one gRPC server, the core worker's.
"""

from __future__ import annotations

from collections import Counter

RAY_DAEMONS = (
    "gcs_server",
    "raylet",
    "ray::DashboardAgent",
    "dashboard/agent.py",
    "dashboard/dashboard.py",
    "_private/monitor.py",
)


def not_rays(wide: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Of (pid, port, command line) of listeners on every interface, those Ray does not
    account for: a Ray daemon's are all Ray's; any other process may have one, its core
    worker's, and a second would be pdserve's (every pdserve listener binds one address)."""
    per_process = Counter(pid for pid, _, _ in wide)
    return [
        (pid, port, command[:120])
        for pid, port, command in wide
        if not any(daemon in command for daemon in RAY_DAEMONS) and per_process[pid] > 1
    ]
