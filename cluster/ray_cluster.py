"""Start or join a Ray cluster without touching any other Ray on the machine.

A local cluster gets a private temp dir, a loopback node address (Ray rewrites 127.0.0.1
to the host's address; 127.0.0.2 stays on loopback), no dashboard, usage stats off, and
Ray's token authentication with a token of its own, held only in the environment of this
process and the processes it starts: Ray 2.60's GCS, raylet and workers listen on every
interface whatever the node address, so without it anyone who reaches the host could run
code in the cluster. It never runs `ray stop`: that kills every Ray process of the user.

Joining a cluster leaves Ray's authentication to the cluster's own environment: the nodes of
deploy/'s configs export RAY_AUTH_MODE=token and hold the token in ~/.ray/auth_token, and
address "auto" turns token mode on by itself where that file exists.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import ray

log = logging.getLogger(__name__)

# Custom resources that steer each pool onto its own nodes (GPU sets on a real cluster).
PREFILL_RESOURCE = "pdserve_prefill"
DECODE_RESOURCE = "pdserve_decode"
# Router slots: the nodes that take client traffic declare how many routers they run (each
# router reserves one). A cluster that declares none runs routers anywhere (spread).
ROUTER_RESOURCE = "pdserve_router"

# A private local cluster only: a joined cluster's auth mode is never overridden.
ISOLATION_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
# Ray starts worker processes, and with them every engine actor, at nice 15 by default:
# under CPU contention the engines then lose to everything else on the node, and streams
# stall (bench/router_capacity.py --worker-niceness 15 0 measures it). The raylet reads
# this at start; deploy/'s `ray start` commands set it too. An operator's value wins.
WORKER_NICENESS_ENV = ("RAY_worker_niceness", "0")
# What Ray 2.60 raises when its raylet misses its fixed registration wait (ray/_private/node.py).
STARTUP_TIMEOUT = "timed out during startup"
# A local cluster's temp dir (short: Ray's socket paths are length-limited) holds its Ray
# logs, kept after it stops for a post-mortem. Ray keeps every session of /tmp/ray; a test
# suite starts dozens of clusters, so a start removes the stopped ones beyond the newest few.
TEMP_ROOT = Path("/tmp")
TEMP_PREFIX = "pdray-"
KEPT_STOPPED_TEMP_DIRS = 8
# A dir younger than this may belong to a cluster whose processes are not up yet.
TEMP_DIR_GRACE_S = 600.0


@dataclass(frozen=True, slots=True)
class LocalClusterConfig:
    node_ip: str = "127.0.0.2"
    num_cpus: int = 2
    # Slots per pool on this single node; on a real cluster node types declare these.
    prefill_slots: int = 8
    decode_slots: int = 8
    router_slots: int = 8
    extra_resources: dict[str, float] = field(default_factory=dict)


def start_local(config: LocalClusterConfig = LocalClusterConfig(), attempts: int = 2) -> str:
    """Start a private single-node cluster in this process; returns its temp dir.

    Ray waits a fixed 30 s for its raylet to register with the GCS, which a machine busy
    with other engines can miss; the node is then started again, fresh, after the processes
    of the half-started one are stopped (`attempts` starts in all)."""
    _private_token_auth()
    os.environ.setdefault(*WORKER_NICENESS_ENV)
    removed = remove_stopped_temp_dirs(TEMP_ROOT)
    if removed:
        log.info("removed %d stopped local clusters' temp dirs (Ray logs) from %s", len(removed), TEMP_ROOT)
    temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=TEMP_ROOT)
    try:
        _init_local(config, temp_dir)
    except Exception as err:
        if STARTUP_TIMEOUT not in str(err) or attempts <= 1:
            raise
        stopped = stop_processes_of(temp_dir)
        log.warning("Ray's node did not register in time (%s): stopped its %d processes, starting again", err, stopped)
        return start_local(config, attempts - 1)
    return temp_dir


def remove_stopped_temp_dirs(
    root: Path, keep: int = KEPT_STOPPED_TEMP_DIRS, grace_s: float = TEMP_DIR_GRACE_S
) -> list[Path]:
    """Remove local clusters' temp dirs under `root` but the newest `keep`, leaving any that a
    running process names (its cluster is up) or that is younger than `grace_s`. Another
    user's dirs stay: removing them fails, and is skipped."""
    in_use = " ".join(" ".join(p.info["cmdline"] or ()) for p in psutil.process_iter(["cmdline"]))
    now = time.time()
    stopped = []
    for path in root.glob(f"{TEMP_PREFIX}*"):
        try:
            modified = path.lstat().st_mtime
        except FileNotFoundError:  # another start removed it
            continue
        if path.is_dir() and not path.is_symlink() and now - modified > grace_s and str(path) not in in_use:
            stopped.append((modified, path))
    stopped.sort(reverse=True)
    removed = []
    for _, path in stopped[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
    return removed


def _private_token_auth() -> None:
    """Token mode with a fresh random token in this process's environment (its children,
    Ray's processes and actors among them, inherit it): no ~/.ray/auth_token is written, so
    the user's other Ray clusters are not switched to it."""
    os.environ.update(ISOLATION_ENV, RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    # Ray read its auth settings when imported; it re-reads them as its own ray.init does
    # when it turns token mode on (ray/_private/authentication/authentication_token_setup.py).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _init_local(config: LocalClusterConfig, temp_dir: str) -> None:
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        _node_ip_address=config.node_ip,
        num_cpus=config.num_cpus,
        resources={
            PREFILL_RESOURCE: config.prefill_slots,
            DECODE_RESOURCE: config.decode_slots,
            ROUTER_RESOURCE: config.router_slots,
            **config.extra_resources,
        },
        include_dashboard=False,
        log_to_driver=False,
        namespace="pdserve",
    )


def stop_processes_of(temp_dir: str) -> int:
    """Kill this process's descendants started for the node under `temp_dir` (the GCS, the
    raylet and their helpers name it in their command lines) with their own children: a
    failed `ray.init` leaves them running. Returns how many were stopped."""

    def names_it(process: psutil.Process) -> bool:
        try:
            return any(temp_dir in part for part in process.cmdline())
        except psutil.Error:
            return False

    roots = [p for p in psutil.Process().children(recursive=True) if names_it(p)]
    family = {p.pid: p for root in roots for p in [root, *_children(root)]}
    for process in family.values():
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(family.values()), timeout=10)
    return len(family)


def _children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def join(address: str) -> None:
    """Connect to a running cluster. RAY_AUTH_MODE stays as the environment has it: setting
    it here would switch a client of a token-auth cluster to no auth (refused)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, namespace="pdserve", log_to_driver=False)
