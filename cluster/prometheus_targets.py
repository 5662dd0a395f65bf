"""Prometheus file-based service discovery for the workers' metrics endpoints.

Each engine actor serves its metrics on a port of its own node, chosen at start (many per
node) and new after every restart, which no static scrape configuration can list. The router
already hears each worker's address in its load reports; with `--prometheus-sd-file` the
pools' owner (the controller in `pdserve serve`) keeps a `file_sd_configs` target file
current, the routers' and its own endpoints included (deploy/prometheus.yml shows the
scrape job).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Mapping

from cluster.pools import Pool


def targets(pools: Iterable[Pool], others: Mapping[str, tuple[str, str]] | None = None) -> list[dict]:
    """One target group per live worker, labelled with its role and actor name, and per
    other process (`others`: name -> (role, address): routers, the controller)."""
    workers = [
        {"targets": [member.load.metrics_address], "labels": {"role": pool.role, "actor": member.name}}
        for pool in pools
        for member in pool.members
        if member.live and member.load is not None and member.load.metrics_address
    ]
    rest = [
        {"targets": [address], "labels": {"role": role, "actor": name}}
        for name, (role, address) in (others or {}).items()
    ]
    return workers + rest


def write_targets(path: Path, pools: Iterable[Pool], others: Mapping[str, tuple[str, str]] | None = None) -> bool:
    """Rewrite `path` (atomically: Prometheus may read it any time) if the targets changed."""
    text = json.dumps(targets(pools, others), indent=1, sort_keys=True)
    if path.exists() and path.read_text() == text:
        return False
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text)
    os.replace(staging, path)
    return True
