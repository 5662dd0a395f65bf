"""Start or stop pdserve (router + prefill and decode pools) on a cluster made by `ray up`.

    python deploy/launch.py CLUSTER.yaml [--prefill N --decode M] [--listen HOST:PORT] [-- SERVE_ARGS]
    python deploy/launch.py CLUSTER.yaml --stop

On your machine it only copies itself to the head with `ray submit` and runs there with
--on-head. On the head it waits for the worker nodes the cluster config starts with, sizes
the pools from the pdserve_prefill / pdserve_decode slots those nodes offer (one engine per
slot) unless --prefill/--decode are given, starts `pdserve serve --address auto` detached
(log in ~/pdserve-serve.log), and returns once the router's gRPC health check says SERVING.

On GPU nodes each engine gets its node's GPUs per slot as its tensor-parallel size (an
8-GPU node with 2 slots: TP 4), and GPU sizing defaults: `pdserve serve` is started with
--device cuda --prefill-tp 4 --decode-tp 4 --gpu-memory-utilization 0.9 --max-model-len 32768.
SERVE_ARGS come after those and override them, flag by flag (e.g. --model DIR --max-model-len 8192).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVE_LOG = "pdserve-serve.log"
SERVE_PID = "pdserve-serve.pid"
POOLS = ("prefill", "decode")
# GPU engines' sizing unless SERVE_ARGS say otherwise: vLLM may take 90% of each GPU, and a
# request may be up to 32k tokens long (`pdserve plan` shows what that costs per engine).
GPU_SIZING = ["--gpu-memory-utilization", "0.9", "--max-model-len", "32768"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = _split(argv)
    parser = argparse.ArgumentParser(prog="deploy/launch.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="cluster YAML given to `ray up` (not with --on-head)")
    parser.add_argument("--prefill", type=int, help="prefill engines (default: every prefill slot; 0: colocated)")
    parser.add_argument("--decode", type=int, help="decode engines (default: every decode slot)")
    parser.add_argument("--listen", default="0.0.0.0:50051", help="gRPC address on the head")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for nodes and engines")
    parser.add_argument("--stop", action="store_true", help="stop pdserve serve (the cluster stays up)")
    parser.add_argument("--on-head", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    if args.on_head:
        sys.stdout.reconfigure(line_buffering=True)  # progress shows through `ray submit` as it happens
        return _stop(Path.home()) if args.stop else _start(args, serve_args, Path.home())
    if not args.config:
        parser.error("the cluster YAML is required")
    return _submit(args, serve_args)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


# ---- on your machine ----------------------------------------------------------------------


def expected_workers(config: dict) -> int:
    """Worker nodes the cluster starts with: each node type's min_workers, as Ray's own
    config preparation fills them in (for the local provider: every host in worker_ips)."""
    from ray.autoscaler._private.util import prepare_config

    node_types = prepare_config(config)["available_node_types"]
    return sum(t.get("min_workers", 0) for t in node_types.values())


def _submit(args: argparse.Namespace, serve_args: list[str]) -> int:
    import yaml

    with open(args.config) as f:
        config = yaml.safe_load(f)
    head_args = ["--on-head", "--timeout", str(args.timeout)]
    if args.stop:
        head_args.append("--stop")
    else:
        head_args += ["--workers", str(expected_workers(config)), "--listen", args.listen]
        head_args += [f"--{pool}={n}" for pool, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None]
    # `ray submit` joins the script's arguments with spaces into a shell command: quote them.
    quoted = [shlex.quote(a) for a in [*head_args, "--", *serve_args]]
    return subprocess.call([_tool("ray"), "submit", args.config, os.path.abspath(__file__), "--", *quoted])


def _tool(name: str) -> str:
    """A console script of this Python environment (`ray`: the same version as the cluster's)."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else name


# ---- on the head --------------------------------------------------------------------------


def _start(args: argparse.Namespace, serve_args: list[str], home: Path) -> int:
    pid = _serving_pid(home)
    if pid:
        print(f"pdserve serve already runs on the head (pid {pid}); --stop it first", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    # Waited for even when both counts are given: the nodes' GPUs decide the engines' TP size.
    try:
        nodes = _wait_for_pool_nodes(args.workers, deadline)
        device_args = gpu_serve_args(nodes)
    except (TimeoutError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    for address, node in sorted(nodes.items()):
        offers = [f"{node[pool]} {pool} slot(s)" for pool in POOLS if node[pool]]
        print(f"node {address}: " + ", ".join(offers + ([f"{node['gpus']} GPU(s)"] if node["gpus"] else [])))
    counts = {"prefill": args.prefill, "decode": args.decode}
    for pool, n in counts.items():
        if n is None:
            counts[pool] = sum(node[pool] for node in nodes.values())
            if not counts[pool]:
                print(f"no worker node offers {pool} slots (`ray status`)", file=sys.stderr)
                return 1
    prefill, decode = counts["prefill"], counts["decode"]
    cmd = [_tool("pdserve"), "serve", "--address", "auto", "--prefill", str(prefill), "--decode", str(decode)]
    cmd += ["--listen", args.listen, *device_args, *serve_args]  # argparse: the later flag wins
    print("starting: " + shlex.join(cmd))
    with open(home / SERVE_LOG, "ab") as log:
        # Own session: it must outlive this SSH session (and its hang-up).
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (home / SERVE_PID).write_text(str(proc.pid))
    if _wait_serving(proc, args.listen, deadline):
        print(f"serving on {args.listen}: {prefill} prefill + {decode} decode engines (log ~/{SERVE_LOG})")
        return 0
    if proc.poll() is None:
        proc.terminate()
    print(f"pdserve serve did not come up; last lines of ~/{SERVE_LOG}:", file=sys.stderr)
    print("\n".join((home / SERVE_LOG).read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
    return 1


def gpu_serve_args(nodes: dict[str, dict[str, int]]) -> list[str]:
    """`pdserve serve` flags for the pool nodes' GPUs: each pool's TP size is its nodes' GPUs
    per slot (the fewest over its nodes, so an engine fits on any of them); none on CPU nodes."""
    if not any(n["gpus"] for n in nodes.values()):
        return []
    per_slot = {pool: {n["gpus"] // n[pool] for n in nodes.values() if n[pool]} for pool in POOLS}
    if 0 in set().union(*per_slot.values()):
        raise ValueError(
            f"a pool node has fewer GPUs than slots, or none beside GPU nodes: {nodes}. pdserve runs every "
            "engine on one device: give each pool node at least one GPU per slot (or no node any GPU)"
        )
    tp = [arg for pool, sizes in per_slot.items() if sizes for arg in (f"--{pool}-tp", str(min(sizes)))]
    return ["--device", "cuda", *tp, *GPU_SIZING]


def _wait_for_pool_nodes(workers: int, deadline: float) -> dict[str, dict[str, int]]:
    """Pool slots and GPUs per node address, once `workers` nodes offer a pool resource."""
    import ray

    from router.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE

    ray.init(address="auto", log_to_driver=False)
    try:
        while True:
            nodes = {
                n["NodeManagerAddress"]: {
                    "prefill": int(n["Resources"].get(PREFILL_RESOURCE, 0)),
                    "decode": int(n["Resources"].get(DECODE_RESOURCE, 0)),
                    "gpus": int(n["Resources"].get("GPU", 0)),
                }
                for n in ray.nodes()
                if n["Alive"] and (PREFILL_RESOURCE in n["Resources"] or DECODE_RESOURCE in n["Resources"])
            }
            if len(nodes) >= workers:
                return nodes
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} of {workers} worker nodes joined in time (`ray status`)")
            time.sleep(2)
    finally:
        ray.shutdown()


def _wait_serving(proc: subprocess.Popen, listen: str, deadline: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = "127.0.0.1"
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass  # not listening yet: the engines are still starting
            time.sleep(1)
    return False


def _serving_pid(home: Path) -> int | None:
    try:
        pid = int((home / SERVE_PID).read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, ValueError):
        return None
    return pid if b"pdserve" in cmdline and not zombie else None


def _stop(home: Path) -> int:
    pid = _serving_pid(home)
    if pid is None:
        print("pdserve serve is not running on the head")
        return 0
    os.kill(pid, signal.SIGTERM)  # graceful: stops gRPC, then kills the engine actors
    deadline = time.monotonic() + 60
    while _serving_pid(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _serving_pid(home):
        print(f"pdserve serve (pid {pid}) ignored SIGTERM for 60 s", file=sys.stderr)
        return 1
    (home / SERVE_PID).unlink(missing_ok=True)
    print(f"stopped pdserve serve (pid {pid})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
