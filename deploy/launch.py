"""Start or stop pdserve (router + prefill and decode pools) on a cluster made by `ray up`.

    python deploy/launch.py CLUSTER.yaml [--prefill N --decode M] [--listen HOST:PORT]
        [--tls-dir DIR --tokens-file FILE] [-- SERVE_ARGS]
    python deploy/launch.py CLUSTER.yaml --stop
    python deploy/launch.py AWS.yaml --create-security-group [--vpc-id VPC]   (before `ray up`)

On your machine it only copies itself to the head with `ray submit` and runs there with
--on-head. On the head it waits for the worker nodes the cluster config starts with, sizes
the pools from the pdserve_prefill / pdserve_decode slots those nodes offer (one engine per
slot) unless --prefill/--decode are given, starts `pdserve serve --address auto` detached
(log in ~/pdserve-serve.log), and returns once the router serves (its gRPC health check
says SERVING; with TLS, its log says so).

On GPU nodes each engine gets its node's GPUs per slot as its tensor-parallel size (an
8-GPU node with 2 slots: TP 4), and GPU sizing defaults: `pdserve serve` is started with
--device cuda --prefill-tp 4 --decode-tp 4 --max-model-len 32768.
SERVE_ARGS come after those and override them, flag by flag (e.g. --model DIR --max-model-len 8192,
or the front door's --max-in-flight N --max-queue N --drain-timeout S).

The front door: --tls-dir and --tokens-file name paths on the head, relative ones in its home
(copy the files there with the config's file_mounts, or `ray rsync-up`). --tls-dir holds
server.pem and server.key, and client-ca.pem for mutual TLS if there; --tokens-file has
ROLE:TOKEN lines (roles generate, admin). The router listens on 0.0.0.0:50051 when it has
both TLS and tokens, else on the head's 127.0.0.1:50051 (reach it with `ray exec`), unless
--listen says otherwise. Its
metrics stay on the head's loopback (--metrics-host 127.0.0.1; a SERVE_ARGS --metrics-host
PRIVATE_IP lets a Prometheus in the cluster's private network scrape it). --stop sends the
router SIGTERM: it stops admitting, gives live streams --drain-timeout seconds, then stops
the engines.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from cli.config import ServeConfig
from configuration.fields import default_of
from router.actor import RouterSettings

SERVE_LOG = "pdserve-serve.log"
SERVE_PID = "pdserve-serve.pid"
SERVING_LINE = "serving pdserve.v1.Generation on "  # what `pdserve serve` logs once it serves
PRIVATE_LISTEN = default_of(RouterSettings, "listen")  # pdserve's own: the head's loopback
PUBLIC_LISTEN = "0.0.0.0:" + PRIVATE_LISTEN.rsplit(":", 1)[1]  # with TLS and tokens
TLS_FILES = {"--tls-cert": "server.pem", "--tls-key": "server.key"}
CLIENT_CA = "client-ca.pem"  # in --tls-dir: require client certificates (mutual TLS)
DRAIN_TIMEOUT_S = default_of(ServeConfig, "drain_timeout_s")
POOLS = ("prefill", "decode")
# GPU engines' sizing unless SERVE_ARGS say otherwise: a request may be up to 32k tokens long
# (`pdserve plan` shows what that costs per engine).
GPU_SIZING = ["--max-model-len", "32768"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = _split(argv)
    parser = argparse.ArgumentParser(prog="deploy/launch.py", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="cluster YAML given to `ray up` (not with --on-head)")
    parser.add_argument("--prefill", type=int, help="prefill engines (default: every prefill slot; 0: colocated)")
    parser.add_argument("--decode", type=int, help="decode engines (default: every decode slot)")
    parser.add_argument(
        "--listen", help=f"gRPC address on the head (default {PUBLIC_LISTEN} with TLS and tokens, or {PRIVATE_LISTEN})"
    )
    parser.add_argument("--tls-dir", help="directory on the head: server.pem, server.key [, client-ca.pem]; serve TLS")
    parser.add_argument("--tokens-file", help="file on the head with ROLE:TOKEN lines (roles generate, admin)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for nodes and engines")
    parser.add_argument("--stop", action="store_true", help="stop pdserve serve: SIGTERM, drain (the cluster stays up)")
    parser.add_argument(
        "--create-security-group",
        action="store_true",
        help="AWS, before `ray up`: create the config's security group (provider.security_group) and print its id",
    )
    parser.add_argument("--vpc-id", help="with --create-security-group: the VPC (default: the region's default VPC)")
    parser.add_argument("--on-head", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    if args.on_head:
        sys.stdout.reconfigure(line_buffering=True)  # progress shows through `ray submit` as it happens
        return _stop(Path.home()) if args.stop else _start(args, serve_args, Path.home())
    if not args.config:
        parser.error("the cluster YAML is required")
    if args.create_security_group:
        return _create_security_group_cli(args)
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
        head_args += ["--workers", str(expected_workers(config))]
        head_args += [
            f"--{pool}={n}" for pool, n in (("prefill", args.prefill), ("decode", args.decode)) if n is not None
        ]
        door = {"--listen": args.listen, "--tls-dir": args.tls_dir, "--tokens-file": args.tokens_file}
        head_args += [a for flag, value in door.items() if value for a in (flag, value)]
    # `ray submit` joins the script's arguments with spaces into a shell command: quote them.
    quoted = [shlex.quote(a) for a in [*head_args, "--", *serve_args]]
    return subprocess.call([_tool("ray"), "submit", args.config, os.path.abspath(__file__), "--", *quoted])


# Documentation ranges (RFC 5737): the configs' placeholder addresses.
_PLACEHOLDER_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]


def _checked_permissions(config: dict) -> list[dict]:
    """provider.security_group.IpPermissions, refused if a range is still a placeholder or
    opens SSH (or every port) to the whole internet."""
    rules = config["provider"].get("security_group", {}).get("IpPermissions", [])
    for rule in rules:
        ranges = [r["CidrIp"] for r in rule.get("IpRanges", [])] + [r["CidrIpv6"] for r in rule.get("Ipv6Ranges", [])]
        ssh = str(rule.get("IpProtocol")) == "-1" or rule.get("FromPort", 0) <= 22 <= rule.get("ToPort", 65535)
        for cidr in ranges:
            net = ipaddress.ip_network(cidr, strict=False)
            if any(net.version == p.version and net.subnet_of(p) for p in _PLACEHOLDER_NETS):
                raise ValueError(f"{cidr} is a placeholder: put your own address range in provider.security_group")
            if ssh and net.prefixlen == 0:
                raise ValueError(f"{cidr} would open SSH to the internet: give your admins' address ranges")
    return rules


def security_group_rules(config: dict, group_id: str) -> list[dict]:
    """Inbound rules of the cluster's group: every port between its members (Ray, NIXL), then
    the config's IpPermissions (SSH and gRPC from the ranges given). Nothing else is open."""
    members = {"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": group_id, "Description": "cluster members"}]}
    return [members, *_checked_permissions(config)]


def create_security_group(config: dict, vpc_id: str | None = None, ec2=None) -> tuple[str, bool]:  # noqa: ANN001
    """The cluster's security group in `vpc_id` (default: the region's default VPC), made from
    the config if no group of its name is there: (group id, created). An existing group is
    left as it is."""
    _checked_permissions(config)  # before anything is created
    if ec2 is None:
        import boto3

        ec2 = boto3.client("ec2", region_name=config["provider"]["region"])
    if vpc_id is None:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise ValueError(f"no default VPC in {config['provider']['region']}: give --vpc-id")
        vpc_id = vpcs[0]["VpcId"]
    name = config["provider"].get("security_group", {}).get("GroupName", config["cluster_name"])
    filters = [{"Name": "vpc-id", "Values": [vpc_id]}, {"Name": "group-name", "Values": [name]}]
    if found := ec2.describe_security_groups(Filters=filters)["SecurityGroups"]:
        return found[0]["GroupId"], False
    group_id = ec2.create_security_group(
        GroupName=name,
        Description=f"pdserve cluster {config['cluster_name']}: members, and SSH and gRPC from configured ranges",
        VpcId=vpc_id,
        TagSpecifications=[
            {"ResourceType": "security-group", "Tags": [{"Key": "ray-cluster-name", "Value": config["cluster_name"]}]}
        ],
    )["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group_id, IpPermissions=security_group_rules(config, group_id))
    return group_id, True


def _create_security_group_cli(args: argparse.Namespace) -> int:
    import yaml

    with open(args.config) as f:
        config = yaml.safe_load(f)
    if config["provider"]["type"] != "aws":
        print("--create-security-group is for AWS configs", file=sys.stderr)
        return 2
    try:
        group_id, created = create_security_group(config, args.vpc_id)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if created:
        rules = "; ".join(_describe(r) for r in security_group_rules(config, group_id))
        print(f"created security group {group_id}: {rules}")
    else:
        print(
            f"security group {group_id} exists already; its rules are as they were (aws ec2 describe-security-groups "
            f"--group-ids {group_id})"
        )
    print(f"put it in {args.config}: SecurityGroupIds: &security_group [{group_id}]")
    return 0


def _describe(rule: dict) -> str:
    protocol = str(rule["IpProtocol"])
    ports = "all ports" if protocol == "-1" else f"{protocol} {rule['FromPort']}-{rule['ToPort']}"
    sources = [r["CidrIp"] for r in rule.get("IpRanges", [])] + [r["CidrIpv6"] for r in rule.get("Ipv6Ranges", [])]
    sources += [f"group {g['GroupId']}" for g in rule.get("UserIdGroupPairs", [])]
    return f"{ports} from {', '.join(sources)}"


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
    try:
        door = front_door_args(args.tls_dir, args.tokens_file, home)  # before the wait: a wrong path fails at once
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
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
    listen = _last_value(serve_args, "--listen") or args.listen or default_listen([*door, *serve_args])
    cmd = [_tool("pdserve"), "serve", "--address", "auto", "--prefill", str(prefill), "--decode", str(decode)]
    cmd += ["--listen", listen, "--metrics-host", "127.0.0.1", *door, *device_args, *serve_args]  # the later flag wins
    print("starting: " + shlex.join(cmd))
    if not _is_loopback(listen) and not (_last_value(cmd, "--tls-cert") and _last_value(cmd, "--tokens-file")):
        print(f"warning: {listen} is reachable beyond the head without TLS and tokens (--tls-dir, --tokens-file)")
    log_path = home / SERVE_LOG
    log_start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as log:
        # Own session: it must outlive this SSH session (and its hang-up).
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    (home / SERVE_PID).write_text(str(proc.pid))
    if _last_value(cmd, "--tls-cert"):  # the health check would need the server's CA (and a client certificate)
        up = _wait_logged_serving(proc, log_path, log_start, deadline)
    else:
        up = _wait_serving(proc, listen, deadline)
    if up:
        print(f"serving on {listen}: {prefill} prefill + {decode} decode engines (log ~/{SERVE_LOG})")
        return 0
    if proc.poll() is None:
        proc.terminate()
    print(f"pdserve serve did not come up; last lines of ~/{SERVE_LOG}:", file=sys.stderr)
    print("\n".join((home / SERVE_LOG).read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
    return 1


def front_door_args(tls_dir: str | None, tokens_file: str | None, home: Path) -> list[str]:
    """`pdserve serve` flags for the TLS files in `tls_dir` and the tokens file: paths on the
    head, relative ones in its home."""
    args = []
    if tls_dir:
        directory = home / Path(tls_dir).expanduser()
        for flag, name in TLS_FILES.items():
            if not (directory / name).is_file():
                raise FileNotFoundError(f"--tls-dir {tls_dir}: no {name} on the head")
            args += [flag, str(directory / name)]
        if (directory / CLIENT_CA).is_file():
            args += ["--tls-client-ca", str(directory / CLIENT_CA)]
    if tokens_file:
        path = home / Path(tokens_file).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--tokens-file {tokens_file}: no such file on the head")
        args += ["--tokens-file", str(path)]
    return args


def default_listen(serve_args: list[str]) -> str:
    """Every interface with TLS and tokens; else the head's loopback."""
    secured = _last_value(serve_args, "--tls-cert") and _last_value(serve_args, "--tokens-file")
    return PUBLIC_LISTEN if secured else PRIVATE_LISTEN


def _last_value(args: list[str], flag: str) -> str | None:
    """The value the last `flag V` or `flag=V` in `args` gives (argparse: the later wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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

    from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE

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
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return True
            except grpc.RpcError:
                pass  # not listening yet: the engines are still starting
            time.sleep(1)
    return False


def _wait_logged_serving(proc: subprocess.Popen, log: Path, start: int, deadline: float) -> bool:
    """Until `pdserve serve` logs that it serves (after byte `start` of its log)."""
    while proc.poll() is None and time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(start)
            if SERVING_LINE.encode() in f.read():
                return True
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
    # Graceful: no new requests, live streams get --drain-timeout seconds, then the engines stop.
    wait_s = _drain_timeout(pid) + 60
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while _serving_pid(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _serving_pid(home):
        print(
            f"pdserve serve (pid {pid}) has not stopped {wait_s:.0f} s after SIGTERM; "
            f"see ~/{SERVE_LOG}, or `kill -KILL {pid}`",
            file=sys.stderr,
        )
        return 1
    (home / SERVE_PID).unlink(missing_ok=True)
    print(f"stopped pdserve serve (pid {pid})")
    return 0


def _drain_timeout(pid: int) -> float:
    """The --drain-timeout the running `pdserve serve` was given."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        return float(_last_value(args, "--drain-timeout") or DRAIN_TIMEOUT_S)
    except (OSError, ValueError):
        return DRAIN_TIMEOUT_S


if __name__ == "__main__":
    sys.exit(main())
