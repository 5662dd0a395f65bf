"""Prometheus file-based service discovery for the workers' metrics endpoints.

Each engine actor serves its metrics on a port of its own node, chosen at start (many per
node) and new after every restart, which no static scrape configuration can list. The router
already hears each worker's address in its load reports; with `--prometheus-sd-file` the
pools' owner (the controller in `pdserve serve`) keeps a `file_sd_configs` target file
current, routers' endpoints included (deploy/prometheus.yml shows the scrape job).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

from router.pools import Pool


def targets(pools: Iterable[Pool], routers: Mapping[str, str] | None = None) -> list[dict]:
    """One target group per live worker (and router), labelled with its role and actor name."""
    workers = [
        {"targets": [member.load.metrics_address], "labels": {"role": pool.role, "actor": member.name}}
        for pool in pools
        for member in pool.members
        if member.alive and member.load is not None and member.load.metrics_address
    ]
    routing = [{"targets": [address], "labels": {"role": "router", "actor": name}} for name, address in (routers or {}).items()]
    return workers + routing


def write_targets(path: Path, pools: Iterable[Pool], routers: Mapping[str, str] | None = None) -> bool:
    """Rewrite `path` (atomically: Prometheus may read it any time) if the targets changed."""
    text = json.dumps(targets(pools, routers), indent=1, sort_keys=True)
    if path.exists() and path.read_text() == text:
        return False
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)
    return True
