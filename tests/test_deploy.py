"""The cluster configs in deploy/, offline: Ray's own validation, pool steering, launch sizing."""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE

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
    config["available_node_types"]["decode"].update(min_workers=config["max_workers"], max_workers=config["max_workers"])
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


def _run_start_commands(commands: list[str], node_ip: str, head_ip: str, tmp_path: Path, gpus: int = 0):
    """Runs Ray start commands as Ray would over SSH to `node_ip`, with `ray` stubbed out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    (bin_dir / "ray").chmod(0o755)
    # This machine's own nvidia-smi, if any, must not decide the slot count.
    gpu_lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})"\n' for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + (gpu_lines or "exit 9\n"))
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SSH_CONNECTION": f"10.9.9.9 40000 {node_ip} 22", "RAY_HEAD_IP": head_ip}
    return [subprocess.run(["bash", "-c", c], check=False, env=env, capture_output=True, text=True) for c in commands]


def _ray_start(results) -> list[list[str]]:
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    return [args for args in (json.loads(r.stdout) for r in results) if args[0] == "start"]


def _resources(start_args: list[str]) -> dict:
    (resources,) = [a for a in start_args if a.startswith("--resources=")]
    return json.loads(resources.split("=", 1)[1])


def test_onprem_workers_join_the_pool_their_address_is_listed_in(tmp_path):
    config = load("onprem.yaml")
    provider = config["provider"]
    pools = set()
    for ip in provider["worker_ips"]:
        (start,) = _ray_start(_run_start_commands(config["worker_start_ray_commands"], ip, provider["head_ip"], tmp_path))
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


def _launch_on_head(monkeypatch, tmp_path, nodes: dict, serve_args: list[str]):
    """Runs launch.py's head side against `nodes` (no Ray, no process started); returns the
    `pdserve serve` command line and its arguments as pdserve's own parser reads them."""
    launch = load_launch()
    started = []

    class Started:
        pid = 4242

        def __init__(self, cmd, **kwargs):
            started.append(cmd)

    monkeypatch.setenv("HOME", str(tmp_path))  # the pid file and log go to the head's home
    monkeypatch.setattr(launch, "_wait_for_pool_nodes", lambda workers, deadline: nodes)
    monkeypatch.setattr(launch.subprocess, "Popen", Started)
    monkeypatch.setattr(launch, "_wait_serving", lambda proc, listen, deadline: True)
    assert launch.main(["--on-head", "--workers", str(len(nodes)), "--", *serve_args]) == 0
    (cmd,) = started
    assert cmd[1] == "serve"

    from router import cli

    parsed = []

    async def serve(args):
        parsed.append(args)
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
    cmd, args = _launch_on_head(monkeypatch, tmp_path, _aws_nodes(), user)
    assert (args.prefill, args.decode) == (2, 2), "two engines per node, one node per pool"
    assert (args.device, args.prefill_tp, args.decode_tp) == ("cuda", 4, 4)
    assert args.gpu_memory_utilization == 0.9 and args.model == "/models/m"
    assert cmd[cmd.index("--max-model-len") + 1] == "32768" and cmd[-len(user) :] == user
    assert args.max_model_len == 8192, "the user's arguments override launch.py's defaults"
    assert "node prefill-0: 2 prefill slot(s), 8 GPU(s)" in capsys.readouterr().out


def test_launch_on_cpu_nodes_adds_no_gpu_flags(monkeypatch, tmp_path):
    nodes = {"10.0.0.11": {"prefill": 1, "decode": 0, "gpus": 0}, "10.0.0.12": {"prefill": 0, "decode": 1, "gpus": 0}}
    _, args = _launch_on_head(monkeypatch, tmp_path, nodes, ["--model", "/models/m"])
    assert (args.prefill, args.decode, args.device, args.prefill_tp, args.decode_tp) == (1, 1, "cpu", 1, 1)
    assert args.max_model_len == 8192  # pdserve's own default


def test_launch_refuses_pools_that_mix_gpu_and_cpu_nodes():
    launch = load_launch()
    nodes = {"a": {"prefill": 2, "decode": 0, "gpus": 8}, "b": {"prefill": 0, "decode": 1, "gpus": 0}}
    with pytest.raises(ValueError, match="one device"):
        launch.gpu_serve_args(nodes)
