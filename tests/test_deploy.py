"""The cluster configs in deploy/, offline: Ray's own validation, pool steering, launch sizing,
and the hardening: Ray token auth on every node, the AWS security group, SSH keys, the front door."""

from __future__ import annotations

import copy
import importlib.util
import ipaddress
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
CONFIGS = sorted(DEPLOY.glob("*.yaml"))
POOLS = (PREFILL_RESOURCE, DECODE_RESOURCE)


def load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def load_launch():
    spec = importlib.util.spec_from_file_location("deploy_launch", DEPLOY / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"aws-h100.yaml", "onprem.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_passes_ray_validation(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(yaml.safe_load(path.read_text())))


def test_validation_rejects_a_broken_config():
    """The check above can fail: a misspelt key; more starting workers than max_workers."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("aws-h100.yaml")
    config["available_node_types"]["prefill"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))
    config = load("aws-h100.yaml")
    config["available_node_types"]["decode"].update(
        min_workers=config["max_workers"], max_workers=config["max_workers"]
    )
    with pytest.raises(ValueError, match="min_workers"):
        validate_config(prepare_config(config))


def test_aws_node_types_keep_each_pool_on_its_own_nodes():
    config = load("aws-h100.yaml")
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert not set(head["resources"]) & set(POOLS), "the head must not host engines"
    offered = {}
    for name, node_type in types.items():
        pools = set(node_type["resources"]) & set(POOLS)
        assert len(pools) <= 1, f"{name} offers both pools"
        for pool in pools:
            offered.setdefault(pool, []).append(name)
            # The launcher starts an engine per slot of the nodes the cluster starts with,
            # each on the node's GPUs per slot (its TP size).
            assert node_type["resources"][pool] >= 1 and node_type.get("min_workers", 0) >= 1, name
            assert node_type["resources"]["GPU"] % node_type["resources"][pool] == 0, name
            assert node_type["min_workers"] <= node_type["max_workers"], name  # Ray checks only the sum
    assert set(offered) == set(POOLS)
    starting = sum(t.get("min_workers", 0) for t in types.values())
    assert config["max_workers"] >= starting, "max_workers would not let the starting ratio come up"


def _run_start_commands(
    commands: list[str], node_ip: str, head_ip: str, tmp_path: Path, gpus: int = 0, token: bool = True
):
    """Runs Ray start commands as Ray would over SSH to `node_ip`, with `ray` stubbed out (it
    prints its arguments and RAY_AUTH_MODE), in a home with the Ray auth token unless not `token`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'args': sys.argv[1:], 'auth_mode': os.environ.get('RAY_AUTH_MODE'),"
        " 'worker_niceness': os.environ.get('RAY_worker_niceness')}))\n"
    )
    (bin_dir / "ray").chmod(0o755)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    token_file = home / ".ray" / "auth_token"
    token_file.unlink(missing_ok=True)
    if token:
        token_file.write_text("0" * 64)
    # This machine's own nvidia-smi, if any, must not decide the slot count.
    gpu_lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + (gpu_lines or "exit 9\n"))
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(home),
        "SSH_CONNECTION": f"10.9.9.9 40000 {node_ip} 22",
        "RAY_HEAD_IP": head_ip,
    }
    return [subprocess.run(["bash", "-c", c], check=False, env=env, capture_output=True, text=True) for c in commands]


def _ray_calls(results) -> list[dict]:
    """Each `ray` invocation: {"args": [...], "auth_mode": RAY_AUTH_MODE, "worker_niceness":
    RAY_worker_niceness, as it saw them}."""
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    return [json.loads(line) for r in results for line in r.stdout.splitlines()]


def _ray_start(results) -> list[list[str]]:
    return [call["args"] for call in _ray_calls(results) if call["args"][0] == "start"]


def _resources(start_args: list[str]) -> dict:
    (resources,) = [a for a in start_args if a.startswith("--resources=")]
    return json.loads(resources.split("=", 1)[1])


def test_onprem_workers_join_the_pool_their_address_is_listed_in(tmp_path):
    config = load("onprem.yaml")
    provider = config["provider"]
    pools = set()
    for ip in provider["worker_ips"]:
        (start,) = _ray_start(
            _run_start_commands(config["worker_start_ray_commands"], ip, provider["head_ip"], tmp_path)
        )
        assert f"--address={provider['head_ip']}:6379" in start
        assert f"--node-ip-address={ip}" in start
        slots = _resources(start)
        assert len(slots) == 1 and list(slots.values()) == [1], "a CPU-only host offers one slot of one pool"
        assert "--num-gpus=0" in start, "a CPU-only host declares no GPUs, whatever Ray would detect"
        pools.update(slots)
    assert pools == set(POOLS), "both pools need hosts"


def test_onprem_8_gpu_host_carries_two_tp4_engines_and_strangers_are_refused(tmp_path):
    config = load("onprem.yaml")
    provider, commands = config["provider"], config["worker_start_ray_commands"]
    host = provider["worker_ips"][0]
    (start,) = _ray_start(_run_start_commands(commands, host, provider["head_ip"], tmp_path, gpus=8))
    assert list(_resources(start).values()) == [2] and "--num-gpus=8" in start

    too_few = _run_start_commands(commands, host, provider["head_ip"], tmp_path, gpus=2)
    assert too_few[-1].returncode != 0
    assert f"worker {host} has 2 GPU(s), fewer than one engine's ENGINE_GPUS=4" in too_few[-1].stderr

    stranger = _run_start_commands(commands, "10.99.99.99", provider["head_ip"], tmp_path)
    assert stranger[-1].returncode != 0
    assert "10.99.99.99 is in neither PREFILL_HOSTS nor DECODE_HOSTS" in stranger[-1].stderr


def test_onprem_head_takes_the_address_it_was_reached_at(tmp_path):
    config = load("onprem.yaml")
    head_ip = config["provider"]["head_ip"]
    (start,) = _ray_start(_run_start_commands(config["head_start_ray_commands"], head_ip, head_ip, tmp_path))
    assert "--head" in start and f"--node-ip-address={head_ip}" in start


def test_launch_waits_for_the_workers_each_config_starts_with():
    launch = load_launch()
    aws = load("aws-h100.yaml")
    assert launch.expected_workers(copy.deepcopy(aws)) == sum(
        t.get("min_workers", 0) for t in aws["available_node_types"].values()
    )
    onprem = load("onprem.yaml")
    assert launch.expected_workers(onprem) == len(onprem["provider"]["worker_ips"])


def test_launch_hands_its_arguments_to_the_head_intact(monkeypatch):
    """`ray submit` joins script arguments with spaces into a shell command."""
    launch = load_launch()
    calls = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    config = str(DEPLOY / "onprem.yaml")
    workers = len(load("onprem.yaml")["provider"]["worker_ips"])
    assert launch.main([config, "--prefill", "3", "--", "--model", "/models/a model", "--device", "cuda"]) == 0
    (cmd,) = calls
    assert cmd[1:4] == ["submit", config, str(DEPLOY / "launch.py")] and cmd[4] == "--"
    on_head = shlex.split(" ".join(cmd[5:]))  # what the head's shell will see
    assert on_head[:2] == ["--on-head", "--timeout"]
    assert on_head[on_head.index("--workers") + 1] == str(workers) and "--prefill=3" in on_head
    assert not any(a.startswith("--decode") for a in on_head)
    assert on_head[on_head.index("--") + 1 :] == ["--model", "/models/a model", "--device", "cuda"]


def _exited_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


EXITED_PID = _exited_pid()  # taken before any test patches subprocess.Popen


def _launch_on_head(monkeypatch, tmp_path, nodes: dict, serve_args: list[str], launch_args: tuple = (), waited=None):
    """Runs launch.py's head side against `nodes` (no Ray, no process started); returns the
    `pdserve serve` command line and its arguments as pdserve's own parser reads them.
    `waited` gets how launch.py waited for the router: "health" (gRPC) or "log" (TLS)."""
    launch = load_launch()
    started = []
    waited = [] if waited is None else waited

    class Started:
        # A process that has exited: a made-up pid may be a live engine of an earlier test,
        # which launch.py would take for a running `pdserve serve`.
        pid = EXITED_PID

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

    monkeypatch.setenv("HOME", str(tmp_path))  # the pid file and log go to the head's home
    monkeypatch.setattr(launch, "_wait_for_pool_nodes", lambda workers, deadline: nodes)
    monkeypatch.setattr(launch.subprocess, "Popen", Started)
    monkeypatch.setattr(launch, "_wait_serving", lambda proc, listen, deadline: waited.append("health") or True)
    monkeypatch.setattr(launch, "_wait_logged_serving", lambda proc, log, start, deadline: waited.append("log") or True)
    assert launch.main(["--on-head", "--workers", str(len(nodes)), *launch_args, "--", *serve_args]) == 0
    assert len(waited) == 1
    (cmd,) = started
    assert cmd[1] == "serve"

    from cli import main as cli

    parsed = []

    async def serve(config):
        parsed.append(config)
        return 0

    monkeypatch.setattr(cli, "_serve", serve)
    assert cli.main(cmd[1:]) == 0
    return cmd, parsed[0]


def _aws_nodes() -> dict:
    """What Ray reports for aws-h100.yaml's starting worker nodes (their types' resources)."""
    types = load("aws-h100.yaml")["available_node_types"]
    nodes = {}
    for name, node_type in types.items():
        r = node_type["resources"]
        for i in range(node_type.get("min_workers", 0)):
            pools = {"prefill": r.get(PREFILL_RESOURCE, 0), "decode": r.get(DECODE_RESOURCE, 0)}
            nodes[f"{name}-{i}"] = {**pools, "gpus": r["GPU"]}
    return nodes


def test_launch_gives_each_aws_engine_a_tp4_share_of_its_8_gpu_node(monkeypatch, tmp_path, capsys):
    user = ["--model", "/models/m", "--max-model-len", "8192"]
    cmd, config = _launch_on_head(monkeypatch, tmp_path, _aws_nodes(), user)
    dep = config.deployment
    assert (dep.num_prefill, dep.num_decode) == (2, 2), "two engines per node, one node per pool"
    assert (dep.engine.device, dep.prefill_sizing.tensor_parallel_size, dep.decode_sizing.tensor_parallel_size) == (
        "cuda",
        4,
        4,
    )
    assert dep.engine.gpu_memory_utilization == 0.9 and dep.engine.model == "/models/m"
    assert cmd[cmd.index("--max-model-len") + 1] == "32768" and cmd[-len(user) :] == user
    assert dep.engine.max_model_len == 8192, "the user's arguments override launch.py's defaults"
    assert "node prefill-0: 2 prefill slot(s), 8 GPU(s)" in capsys.readouterr().out


def test_launch_on_cpu_nodes_adds_no_gpu_flags(monkeypatch, tmp_path):
    nodes = {"10.0.0.11": {"prefill": 1, "decode": 0, "gpus": 0}, "10.0.0.12": {"prefill": 0, "decode": 1, "gpus": 0}}
    _, config = _launch_on_head(monkeypatch, tmp_path, nodes, ["--model", "/models/m"])
    dep = config.deployment
    assert (dep.num_prefill, dep.num_decode, dep.engine.device) == (1, 1, "cpu")
    assert (dep.role_engine("prefill").tensor_parallel_size, dep.role_engine("decode").tensor_parallel_size) == (1, 1)
    assert dep.engine.max_model_len == 8192  # pdserve's own default


def test_launch_refuses_pools_that_mix_gpu_and_cpu_nodes():
    launch = load_launch()
    nodes = {"a": {"prefill": 2, "decode": 0, "gpus": 8}, "b": {"prefill": 0, "decode": 1, "gpus": 0}}
    with pytest.raises(ValueError, match="one device"):
        launch.gpu_serve_args(nodes)


# ---- hardening: Ray token auth, network, SSH keys, the front door -----------------------------


def _start_commands(config: dict) -> dict[str, tuple[list[str], str]]:
    """Each config's head and worker start commands, with an address each runs at."""
    provider = config["provider"]
    head = provider.get("head_ip", "10.0.0.10")
    worker = provider.get("worker_ips", ["10.0.0.11"])[0]
    return {"head": (config["head_start_ray_commands"], head), "worker": (config["worker_start_ray_commands"], worker)}


@pytest.mark.parametrize("name", ["aws-h100.yaml", "onprem.yaml"])
def test_every_ray_start_runs_with_token_auth_and_engines_at_normal_priority(name, tmp_path):
    config = load(name)
    for role, (commands, ip) in _start_commands(config).items():
        calls = _ray_calls(_run_start_commands(commands, ip, "10.0.0.10", tmp_path))
        starts = [c for c in calls if c["args"][0] == "start"]
        assert len(starts) == 1, (role, calls)
        assert starts[0]["auth_mode"] == "token", f"{name}: the {role}'s `ray start` runs without RAY_AUTH_MODE=token"
        assert starts[0]["worker_niceness"] == "0", f"{name}: the {role}'s engines would run at Ray's nice 15"
        if role == "head":
            assert "--dashboard-host=127.0.0.1" in starts[0]["args"], "the dashboard must stay on the head's loopback"


@pytest.mark.parametrize("name", ["aws-h100.yaml", "onprem.yaml"])
def test_nodes_without_the_ray_token_refuse_to_start(name, tmp_path):
    config = load(name)
    for role, (commands, ip) in _start_commands(config).items():
        results = _run_start_commands(commands, ip, "10.0.0.10", tmp_path, token=False)
        failed = [r for r in results if r.returncode != 0]
        assert failed, f"{name}: the {role} started Ray without ~/.ray/auth_token"
        assert "no Ray auth token at ~/.ray/auth_token" in failed[0].stderr
        assert "ray get-auth-token --generate" in failed[0].stderr
        # Ray runs start commands in order and stops at the first that fails: nothing ran before it.
        before = results[: results.index(failed[0])]
        assert not any(r.stdout for r in before), f"{name}: the {role} ran `ray` before checking the token"


@pytest.mark.parametrize("name", ["aws-h100.yaml", "onprem.yaml"])
def test_the_ray_token_goes_to_every_node_and_later_commands_use_token_auth(name, tmp_path):
    config = load(name)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # Later commands (`ray status`, launch.py, `pdserve serve`) read ~/.bashrc (Ray runs them in `bash -i`).
    (auth_line,) = [c for c in config["setup_commands"] if "RAY_AUTH_MODE" in c]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    for _ in range(2):  # setup commands run again on every `ray up`
        subprocess.run(["bash", "-c", auth_line], check=True, env=env)
    assert (tmp_path / ".bashrc").read_text().count("RAY_AUTH_MODE") == 1
    seen = subprocess.run(
        ["bash", "-c", "source ~/.bashrc; echo $RAY_AUTH_MODE"], env=env, capture_output=True, text=True
    )
    assert seen.stdout.strip() == "token"


def _world_open(cidr: str) -> bool:
    return ipaddress.ip_network(cidr, strict=False).prefixlen == 0


def test_aws_security_group_opens_ssh_and_grpc_to_the_configured_ranges_only():
    config = load("aws-h100.yaml")
    rules = config["provider"]["security_group"]["IpPermissions"]
    assert {(r["IpProtocol"], r["FromPort"], r["ToPort"]) for r in rules} == {("tcp", 22, 22), ("tcp", 50051, 50051)}
    cidrs = [x["CidrIp"] for r in rules for x in r.get("IpRanges", [])]
    cidrs += [x["CidrIpv6"] for r in rules for x in r.get("Ipv6Ranges", [])]
    assert cidrs and not any(_world_open(c) for c in cidrs), cidrs
    assert "0.0.0.0/0" not in (DEPLOY / "aws-h100.yaml").read_text().split("#")[0]
    # Ray's own group would add SSH from 0.0.0.0/0: every node type names the group made from
    # the rules above instead (on its EFA interfaces, for the GPU nodes), so Ray creates and
    # edits no group. With NetworkInterfaces, Ray's AWS bootstrap takes every interface's
    # Groups as the node's (and refuses SecurityGroupIds beside them).
    groups = set()
    for name, node_type in config["available_node_types"].items():
        node_config = node_type["node_config"]
        if "NetworkInterfaces" in node_config:
            assert "SecurityGroupIds" not in node_config, name
            per_card = [card.get("Groups") for card in node_config["NetworkInterfaces"]]
            assert all(per_card), f"{name} would get Ray's world-open SSH"
            groups |= {g for card in per_card for g in card}
        else:
            assert node_config.get("SecurityGroupIds"), f"{name} would get Ray's world-open SSH"
            groups |= set(node_config["SecurityGroupIds"])
    assert len(groups) == 1


def test_aws_pool_nodes_carry_every_efa_card_in_one_placement_group():
    """KV moves between p5 nodes over EFA (--fabric efa): all 32 network cards as EFA
    interfaces, the nodes in one cluster placement group, and the fabric's NIXL backend
    among the installed NIXL's plugins (its libfabric is the AMI's, absent here)."""
    from kv_transfer.fabrics import FABRICS

    config = load("aws-h100.yaml")
    for name in ("prefill", "decode"):
        node_config = config["available_node_types"][name]["node_config"]
        cards = node_config["NetworkInterfaces"]
        assert sorted(c["NetworkCardIndex"] for c in cards) == list(range(32)), name
        assert {c["InterfaceType"] for c in cards} == {"efa"} and cards[0]["DeviceIndex"] == 0
        assert node_config["Placement"]["GroupName"]
    assert "--fabric efa" in (DEPLOY / "aws-h100.yaml").read_text()
    assert FABRICS["efa"].backends == ("LIBFABRIC",)


class FakeEC2:
    """The boto3 EC2 client calls launch.create_security_group makes."""

    def __init__(self, existing: list[dict] | None = None) -> None:
        self.existing = existing or []
        self.calls: list[tuple[str, dict]] = []

    def describe_vpcs(self, **kw):
        self.calls.append(("describe_vpcs", kw))
        return {"Vpcs": [{"VpcId": "vpc-default"}]}

    def describe_security_groups(self, **kw):
        self.calls.append(("describe_security_groups", kw))
        return {"SecurityGroups": self.existing}

    def create_security_group(self, **kw):
        self.calls.append(("create_security_group", kw))
        return {"GroupId": "sg-new"}

    def authorize_security_group_ingress(self, **kw):
        self.calls.append(("authorize_security_group_ingress", kw))


def _aws_with_ranges(ssh: str, grpc: str = "10.0.0.0/8") -> dict:
    config = load("aws-h100.yaml")
    for rule in config["provider"]["security_group"]["IpPermissions"]:
        rule["IpRanges"] = [{"CidrIp": ssh if rule["FromPort"] == 22 else grpc}]
    return config


def test_create_security_group_builds_the_group_from_the_config():
    launch = load_launch()
    # The shipped config still holds the placeholder admin address: nothing is created.
    ec2 = FakeEC2()
    with pytest.raises(ValueError, match="placeholder"):
        launch.create_security_group(load("aws-h100.yaml"), ec2=ec2)
    assert ec2.calls == []
    with pytest.raises(ValueError, match="SSH to the internet"):
        launch.create_security_group(_aws_with_ranges("0.0.0.0/0"), ec2=FakeEC2())

    config = _aws_with_ranges("198.18.7.7/32")
    assert launch.create_security_group(config, ec2=ec2) == ("sg-new", True)
    created = dict(ec2.calls)
    assert created["create_security_group"]["VpcId"] == "vpc-default"
    assert created["create_security_group"]["GroupName"] == config["provider"]["security_group"]["GroupName"]
    members, *rest = created["authorize_security_group_ingress"]["IpPermissions"]
    assert members["IpProtocol"] == "-1" and [g["GroupId"] for g in members["UserIdGroupPairs"]] == ["sg-new"]
    assert rest == config["provider"]["security_group"]["IpPermissions"]

    existing = FakeEC2(existing=[{"GroupId": "sg-old"}])
    assert launch.create_security_group(config, vpc_id="vpc-1", ec2=existing) == ("sg-old", False)
    assert [name for name, _ in existing.calls] == ["describe_security_groups"], "an existing group is left alone"


def test_ssh_keys_are_the_clusters_own():
    aws = load("aws-h100.yaml")
    # No ssh_private_key: `ray up` creates an EC2 key pair, named for this cluster.
    assert "ssh_private_key" not in aws["auth"] and aws["provider"]["key_pair"]["key_name"] == aws["cluster_name"]
    key = load("onprem.yaml")["auth"]["ssh_private_key"]
    personal = {f"~/.ssh/id_{kind}" for kind in ("rsa", "dsa", "ecdsa", "ed25519", "ecdsa_sk", "ed25519_sk")}
    assert key not in personal and key == "~/.ssh/pdserve_cluster"


def _front_door_files(home: Path, client_ca: bool = False) -> None:
    (home / "front").mkdir()
    for name in ("server.pem", "server.key") + (("client-ca.pem",) if client_ca else ()):
        (home / "front" / name).write_text("x")
    (home / "front" / "tokens").write_text("generate:" + "t" * 16)  # read as pdserve parses its flags


def test_launch_passes_tls_and_tokens_and_listens_beyond_the_head_only_with_both(monkeypatch, tmp_path):
    _front_door_files(tmp_path, client_ca=True)
    waited = []
    door = ("--tls-dir", "front", "--tokens-file", "~/front/tokens")  # relative: the head's home
    cmd, config = _launch_on_head(monkeypatch, tmp_path, _aws_nodes(), ["--drain-timeout", "5"], door, waited)
    front = tmp_path / "front"
    assert cmd[cmd.index("--tls-cert") + 1] == str(front / "server.pem")
    assert cmd[cmd.index("--tls-key") + 1] == str(front / "server.key")
    assert cmd[cmd.index("--tls-client-ca") + 1] == str(front / "client-ca.pem")
    assert cmd[cmd.index("--tokens-file") + 1] == str(front / "tokens")
    router = config.router
    tls = router.front.tls
    assert (tls.cert, tls.key, tls.client_ca) == (
        str(front / "server.pem"),
        str(front / "server.key"),
        str(front / "client-ca.pem"),
    )
    assert router.front.tokens is not None, "the tokens file was read"
    assert router.listen == "0.0.0.0:50051" and router.metrics_host == "127.0.0.1" and config.drain_timeout_s == 5
    assert waited == ["log"], "with TLS launch.py waits for the router's log line, not a plaintext health check"


def test_launch_keeps_grpc_and_metrics_on_the_heads_loopback_without_tls_and_tokens(monkeypatch, tmp_path):
    _front_door_files(tmp_path)
    nodes = {"10.0.0.11": {"prefill": 1, "decode": 0, "gpus": 0}, "10.0.0.12": {"prefill": 0, "decode": 1, "gpus": 0}}
    waited = []
    _, config = _launch_on_head(monkeypatch, tmp_path, nodes, [], waited=waited)
    router = config.router
    assert router.listen == "127.0.0.1:50051" and router.metrics_host == "127.0.0.1" and router.front.tls is None
    assert waited == ["health"]
    _, config = _launch_on_head(monkeypatch, tmp_path, nodes, [], ("--tls-dir", str(tmp_path / "front")))
    router = config.router
    assert router.front.tls and router.front.tokens is None and router.listen == "127.0.0.1:50051", "TLS without tokens"
    _, config = _launch_on_head(monkeypatch, tmp_path, nodes, ["--listen", "0.0.0.0:6000", "--allow-unauthenticated"])
    assert config.router.listen == "0.0.0.0:6000", "an explicit --listen wins"


def test_launch_refuses_missing_front_door_files_before_waiting_for_nodes(monkeypatch, tmp_path, capsys):
    launch = load_launch()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(launch, "_wait_for_pool_nodes", lambda workers, deadline: pytest.fail("waited for nodes"))
    assert launch.main(["--on-head", "--tls-dir", "front"]) == 1
    assert "--tls-dir front: no server.pem on the head" in capsys.readouterr().err
    assert launch.main(["--on-head", "--tokens-file", "nope"]) == 1
    assert "--tokens-file nope: no such file on the head" in capsys.readouterr().err


def test_launch_hands_the_front_door_options_to_the_head(monkeypatch):
    launch = load_launch()
    calls = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    config = str(DEPLOY / "onprem.yaml")
    door = ["--tls-dir", "pdserve-front", "--tokens-file", "pdserve-front/tokens", "--listen", "0.0.0.0:50051"]
    assert launch.main([config, *door, "--", "--max-in-flight", "64"]) == 0
    on_head = shlex.split(" ".join(calls[0][5:]))
    for flag, value in zip(door[::2], door[1::2]):
        assert on_head[on_head.index(flag) + 1] == value
    assert on_head[on_head.index("--") + 1 :] == ["--max-in-flight", "64"]


def test_launch_stop_drains_with_sigterm(tmp_path):
    """A stand-in for `pdserve serve` that records the signal it gets and exits."""
    launch = load_launch()
    got = tmp_path / "signal"
    code = (
        "import signal, sys, time, pathlib\n"
        f"def stop(sig, frame): pathlib.Path({str(got)!r}).write_text(str(sig)); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "pdserve", "serve", "--drain-timeout", "7"])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.05)
        (tmp_path / launch.SERVE_PID).write_text(str(proc.pid))
        assert launch._drain_timeout(proc.pid) == 7
        assert launch._stop(tmp_path) == 0
        assert got.read_text() == str(int(signal.SIGTERM))
        assert not (tmp_path / launch.SERVE_PID).exists()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
