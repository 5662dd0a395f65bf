"""The deploy/ configs on real Ray machinery, on this one machine, inside a sandbox.

- Ray's fake multi-node provider with deploy/aws-h100.yaml's node types: actors asking for
  what an engine asks for launch a node of the matching type; idle nodes are released.
- `ray up` of deploy/onprem.yaml on loopback: three SSH "hosts" (head, prefill, decode), Ray
  token authentication on as the config sets it up, deploy/launch.py brings up the router and
  pools behind TLS and tokens, one gRPC generation, `ray down`.

Each test runs in a `Sandbox` (tests/sandbox.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from certificates import write_certificates
from conftest import wait_until
from sandbox import REPO, Sandbox, client_env, ensure_debian_packages, tail

from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE

DEPLOY = REPO / "deploy"
HEAD, PREFILL_HOST, DECODE_HOST = "127.0.0.2", "127.0.0.3", "127.0.0.4"
SSH_KEY = "/root/.ssh/id_ed25519"  # inside the sandbox


# ---- fake multi-node autoscaling with the AWS node types ------------------------------------


def fake_cluster_config() -> dict:
    """deploy/aws-h100.yaml's node types on Ray's fake provider, starting empty, with a
    6 s idle timeout."""
    aws = yaml.safe_load((DEPLOY / "aws-h100.yaml").read_text())
    head = aws["head_node_type"]
    node_types = {head: {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0}}
    for name, node_type in aws["available_node_types"].items():
        if name == head:
            continue
        engines = sum(node_type["resources"].get(r, 0) for r in (PREFILL_RESOURCE, DECODE_RESOURCE))
        node_types[name] = {
            # AWS reads CPUs and GPUs off the instance type; here: one GPU per engine slot.
            "resources": {"CPU": 1, "GPU": engines, "object_store_memory": 100 << 20, **node_type["resources"]},
            "node_config": {},
            "min_workers": 0,  # nodes must come from demand
            "max_workers": node_type["max_workers"],
        }
    commands = ("initialization", "setup", "head_setup", "worker_setup", "head_start_ray", "worker_start_ray")
    return {
        "cluster_name": "pdserve-fake",
        "max_workers": aws["max_workers"],
        "upscaling_speed": aws["upscaling_speed"],
        "idle_timeout_minutes": 0.1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {},
        "docker": {},
        "available_node_types": node_types,
        "head_node_type": head,
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        **{f"{c}_commands": [] for c in commands},
    }


def drive_fake_cluster() -> None:
    """Runs inside the sandbox as a Ray driver: prints one JSON line per observation."""
    import ray

    ray.init(address="auto", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Engine:  # asks for what a pdserve engine actor asks for on a GPU cluster
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    def pool_nodes() -> dict[str, list[str]]:
        alive = [n for n in ray.nodes() if n["Alive"]]
        return {
            r: sorted(n["NodeID"] for n in alive if r in n["Resources"]) for r in (PREFILL_RESOURCE, DECODE_RESOURCE)
        }

    def report(step: str, **fields: object) -> None:
        print(
            json.dumps({"step": step, "t": round(time.monotonic() - start, 1), "pool_nodes": pool_nodes(), **fields}),
            flush=True,
        )

    start = time.monotonic()
    report("empty")
    engines = []
    for resource in (PREFILL_RESOURCE, DECODE_RESOURCE):
        engine = Engine.options(resources={resource: 1}, num_gpus=1).remote()
        engines.append(engine)
        report(f"{resource} actor up", node=ray.get(engine.node.remote(), timeout=90))
    for engine in engines:
        ray.kill(engine)
    deadline = time.monotonic() + 90
    while any(pool_nodes().values()) and time.monotonic() < deadline:
        time.sleep(1)
    report("idle")


@pytest.mark.slow
def test_engines_launch_their_node_types_and_idle_nodes_go(sandbox):
    (sandbox.home / "fake.yaml").write_text(yaml.safe_dump(fake_cluster_config()))
    env = client_env(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
    sandbox.run(
        "ray start --head --port=6379 --autoscaling-config=/root/fake.yaml --num-cpus=1 "
        "--object-store-memory=100000000 --include-dashboard=false",
        timeout=90,
        env=env,
        check=True,
    )
    drive = sandbox.run(
        "cd tests && python -c 'from test_deploy_loopback import drive_fake_cluster; drive_fake_cluster()'",
        timeout=300,
        env=env,
    )
    assert drive.returncode == 0, tail(drive)
    steps = {s["step"]: s for s in map(json.loads, drive.stdout.splitlines())}
    print(json.dumps(steps, indent=1))

    assert steps["empty"]["pool_nodes"] == {PREFILL_RESOURCE: [], DECODE_RESOURCE: []}
    prefill_up = steps[f"{PREFILL_RESOURCE} actor up"]
    assert prefill_up["pool_nodes"] == {PREFILL_RESOURCE: [prefill_up["node"]], DECODE_RESOURCE: []}
    decode_up = steps[f"{DECODE_RESOURCE} actor up"]
    assert decode_up["pool_nodes"] == {PREFILL_RESOURCE: [prefill_up["node"]], DECODE_RESOURCE: [decode_up["node"]]}
    assert steps["idle"]["pool_nodes"] == {PREFILL_RESOURCE: [], DECODE_RESOURCE: []}, "idle nodes were not released"


# ---- `ray up` on loopback -------------------------------------------------------------------

SSHD_CONFIG = """\
ListenAddress {ip}:22
HostKey /root/.ssh/host_key
AuthorizedKeysFile /root/.ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PidFile none
MaxStartups 100
MaxSessions 100
LogLevel ERROR
"""

# What the on-prem setup commands leave in ~/.bashrc (~/pdserve is this checkout here; the
# config's own ~/.bashrc setup commands still run and add `export RAY_AUTH_MODE=token`), plus:
# the hosts count as CPU hosts even on a GPU machine (no nvidia-smi: one engine slot each);
# `ray down` stops only the head's Ray on the local provider, and a worker's raylet exits once
# the head's GCS has been gone this long (60 s by default; its agents follow within a minute).
BASHRC = """\
source ~/pdserve/.venv/bin/activate
export PATH=~/cpu-host:$PATH
export RAY_USAGE_STATS_ENABLED=0 RAY_gcs_rpc_server_reconnect_timeout_s=10
"""
# The router's front door, as deploy/README.md sets it up: TLS files and tokens in ~/pdserve-front
# (copied by the file_mounts line onprem.yaml has commented out).
FRONT = "pdserve-front"
GENERATE_TOKEN = "gen-" + "loopback" * 4


def start_ssh_hosts(box: Sandbox, ips: list[str]) -> None:
    """One sshd per host address, each in its own PID and mount namespace with its own /tmp:
    every host sees only its own Ray (`ray stop` on one host leaves the others alone)."""
    ensure_debian_packages({"/usr/sbin/sshd": "openssh-server", "rsync": "rsync"})
    ssh = box.home / ".ssh"
    for key in ("id_ed25519", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", ssh / key], check=True)
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    for ip in ips:
        node = box.home / "hosts" / ip
        (node / "tmp").mkdir(parents=True)
        (node / "sshd_config").write_text(SSHD_CONFIG.format(ip=ip))
        inside = f"/root/hosts/{ip}"
        private_tmp = f"mount --bind {inside}/tmp /tmp"
        if REPO.is_relative_to("/tmp"):  # the venv's scripts name their interpreter by this path
            private_tmp += f" && mkdir -p {REPO} && mount --bind /root/pdserve {REPO}"
        box.spawn(
            "unshare --pid --fork --mount --mount-proc --propagation=private --kill-child "
            f"sh -c '{private_tmp} && exec /usr/sbin/sshd -D -e -f {inside}/sshd_config'",
            f"sshd-{ip}.log",
        )
    probe = f"ssh -i {SSH_KEY} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o BatchMode=yes"
    for ip in ips:
        assert wait_until(lambda ip=ip: box.run(f"{probe} root@{ip} true").returncode == 0, 10), f"no sshd on {ip}"


def loopback_config() -> dict:
    """deploy/onprem.yaml with the loopback hosts, root's sandbox key, the front door's files
    mounted, and no install (the hosts share this checkout's venv): of the setup commands only
    those that write ~/.bashrc run, Ray's token auth among them."""
    config = yaml.safe_load((DEPLOY / "onprem.yaml").read_text())
    config["cluster_name"] = "pdserve-loopback"
    config["provider"].update(head_ip=HEAD, worker_ips=[PREFILL_HOST, DECODE_HOST])
    config["auth"] = {"ssh_user": "root", "ssh_private_key": SSH_KEY}
    config["setup_commands"] = [c for c in config["setup_commands"] if c.endswith(">> ~/.bashrc")]
    assert any("RAY_AUTH_MODE=token" in c for c in config["setup_commands"]), "onprem.yaml no longer sets token auth"
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token", "onprem.yaml mounts no Ray token"
    config["file_mounts"][f"~/{FRONT}"] = f"~/{FRONT}"
    *before, start = config["worker_start_ray_commands"]
    start, n_prefill = re.subn(r'PREFILL_HOSTS="[^"]*"', f'PREFILL_HOSTS="{PREFILL_HOST}"', start)
    start, n_decode = re.subn(r'DECODE_HOSTS="[^"]*"', f'DECODE_HOSTS="{DECODE_HOST}"', start)
    assert n_prefill == n_decode == 1, "onprem.yaml's last worker start command no longer sets the pools' hosts"
    # All hosts share one network namespace here, and every node's dashboard agent also binds
    # 127.0.0.1:52365: the workers take a free port instead.
    config["worker_start_ray_commands"] = [*before, start + " --dashboard-agent-listen-port=0"]
    return config


def write_front_door(directory: Path) -> None:
    """A CA, a server certificate for the head's address, tokens for the router, a client token."""
    write_certificates(directory, HEAD)  # ca.pem, server.pem, server.key (and a client certificate)
    (directory / "tokens").write_text(f"generate:{GENERATE_TOKEN}\nadmin:adm-{'x' * 28}\n")
    (directory / "client-token").write_text(GENERATE_TOKEN)


def prepare_home(box: Sandbox, model_path: str) -> None:
    """The hosts' shared /root (this checkout is mounted as ~/pdserve): ~/.bashrc, the model, the
    front door's files, the config."""
    (box.home / ".bashrc").write_text(BASHRC)
    write_front_door(box.home / FRONT)
    (box.home / "cpu-host").mkdir()
    (box.home / "cpu-host" / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (box.home / "cpu-host" / "nvidia-smi").chmod(0o755)
    shutil.copytree(model_path, box.home / "model")
    (box.home / "cluster.yaml").write_text(yaml.safe_dump(loopback_config(), sort_keys=False))


@pytest.mark.slow
def test_ray_up_on_loopback_serves_a_generation(sandbox, model_path):
    start_ssh_hosts(sandbox, [HEAD, PREFILL_HOST, DECODE_HOST])
    prepare_home(sandbox, model_path)
    # Autoscaler v2 never launches the local provider's workers.
    env = client_env(RAY_UP_enable_autoscaler_v2="0")
    timings = {}

    def timed(name: str, cmd: str, timeout: float) -> subprocess.CompletedProcess:
        t0 = time.monotonic()
        result = sandbox.run(cmd, timeout=timeout, env=env)
        timings[name] = round(time.monotonic() - t0, 1)
        return result

    def step(name: str, cmd: str, timeout: float) -> subprocess.CompletedProcess:
        result = timed(name, cmd, timeout)
        assert result.returncode == 0, f"{name} failed:\n{tail(result)}"
        return result

    # The operator's one-time step: the cluster's Ray token, which file_mounts copies to every host.
    step("token", "ray get-auth-token --generate >/dev/null && chmod 600 ~/.ray/auth_token", 60)
    try:
        step("ray up", "ray up -y /root/cluster.yaml", 240)
        door = f"--tls-dir {FRONT} --tokens-file {FRONT}/tokens"  # paths in the head's home
        launch_cmd = f"python deploy/launch.py /root/cluster.yaml {door} --timeout 150 -- --model /root/model"
        launch = step("launch", launch_cmd, 240)
        assert f"node {PREFILL_HOST}: 1 prefill slot(s)" in launch.stdout, tail(launch)
        assert f"node {DECODE_HOST}: 1 decode slot(s)" in launch.stdout, tail(launch)
        assert "serving on 0.0.0.0:50051: 1 prefill + 1 decode engines" in launch.stdout, tail(launch)
        status = step("ray status", "ray exec /root/cluster.yaml 'ray status'", 60)
        assert re.search(rf"1(\.0)?/1(\.0)? {PREFILL_RESOURCE}", status.stdout), tail(status)
        assert re.search(rf"1(\.0)?/1(\.0)? {DECODE_RESOURCE}", status.stdout), tail(status)
        # Token auth is on: a client without the token is refused by the head's GCS.
        stranger = timed("ray status, no token", f"RAY_AUTH_MODE=disabled ray status --address {HEAD}:6379", 60)
        assert stranger.returncode != 0 and "InvalidAuthToken" in stranger.stdout + stranger.stderr, tail(stranger)

        front = f"--target {HEAD}:50051 --tls-ca /root/{FRONT}/ca.pem"
        refused = timed("generate, no token", f"pdserve generate {front} --max-tokens 8 'no token'", 60)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr, tail(refused)
        token = f"--token-file /root/{FRONT}/client-token"
        gen = step("generate", f"pdserve generate {front} {token} --max-tokens 8 'Prefill reads the prompt'", 60)
        usage = re.search(r"prompt / completion tokens\s+(\d+) / (\d+)", gen.stdout)
        assert usage and int(usage[1]) > 0 and int(usage[2]) > 0, tail(gen)
        assert re.search(r"^prefill .* on prefill-0$", gen.stdout, re.MULTILINE), tail(gen)
        assert re.search(r"on decode-0$", gen.stdout, re.MULTILINE), tail(gen)

        stop = step("launch --stop", "python deploy/launch.py /root/cluster.yaml --stop", 90)
        assert "stopped pdserve serve" in stop.stdout, tail(stop)
    finally:
        down = timed("ray down", "ray down -y /root/cluster.yaml", 120)
        print(timings)
    assert down.returncode == 0, tail(down)
    core = {"gcs_server", "raylet", "pdserve"}
    assert wait_until(lambda: not sandbox.running(core), 30), f"still running after ray down: {sandbox.running(core)}"
