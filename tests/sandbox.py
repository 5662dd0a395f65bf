"""Sandboxes for tests that run clusters of "hosts" on this machine.

`Sandbox` gives a test private network (loopback only), PID and mount namespaces with their
own /root and /tmp, so nothing touches another Ray on this machine, root's real home or /tmp,
and killing the sandbox's first process kills everything started inside it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


class Sandbox:
    """Private net/PID/mount namespaces. /root is `home`, /tmp is `workspace/tmp` inside."""

    def __init__(self, workspace: Path) -> None:
        self.home = workspace / "home"
        self.logs = workspace / "logs"
        for d in (self.home / ".ssh", workspace / "tmp", self.logs):
            d.mkdir(parents=True, mode=0o700)
        # vLLM inspects a model's class once per home, in a subprocess of its own (an import
        # of vLLM and torch, seconds of a core), and keeps the answer here: the hosts get
        # this machine's, as hosts that have served the model before.
        modelinfos = Path.home() / ".cache" / "vllm" / "modelinfos"
        if modelinfos.is_dir():
            shutil.copytree(modelinfos, self.home / ".cache" / "vllm" / "modelinfos")
        # unshare dies with this process (setpriv --pdeathsig) and its child, the namespaces'
        # init, dies with unshare (--kill-child): even a killed test run leaves nothing behind.
        self._holder = subprocess.Popen(
            [
                "setpriv",
                "--pdeathsig=KILL",
                "unshare",
                "--net",
                "--pid",
                "--fork",
                "--mount",
                "--mount-proc",
                "--propagation=private",
                "--kill-child",
                "sleep",
                "infinity",
            ]
        )
        self._background: list[subprocess.Popen] = []
        try:
            self.init_pid = self._child_of(self._holder.pid)
            self._mount_private_dirs(workspace)
        except BaseException:
            self.close()
            raise

    def _mount_private_dirs(self, workspace: Path) -> None:
        # Paths the hosts need that live under the masked /root or /tmp (pyenv's interpreter,
        # a checkout cloned under /tmp as CI may do) stay visible, read-only, at their path.
        private = {Path.home(): self.home, Path("/tmp"): workspace / "tmp"}
        mounts = ["ip link set lo up"]
        for needed in (Path(sys.base_prefix), REPO):
            for masked, replacement in private.items():
                if needed.is_relative_to(masked) and not replacement.is_relative_to(needed):
                    inside = replacement / needed.relative_to(masked)
                    inside.mkdir(parents=True, exist_ok=True)
                    mounts += [f"mount --bind {needed} {inside}", f"mount -o remount,bind,ro {inside}"]
        # The hosts' shared home holds this checkout as ~/pdserve (what onprem.yaml's setup makes).
        (self.home / "pdserve").mkdir()
        mounts += [f"mount --bind {REPO} {self.home / 'pdserve'}", f"mount -o remount,bind,ro {self.home / 'pdserve'}"]
        mounts += [
            f"mount --rbind {self.home} /root",
            f"mount --rbind {workspace / 'tmp'} /tmp",
            "mount -t tmpfs tmpfs /run",  # sshd wants /run/sshd; keep it off the real /run
            "mkdir -m 755 /run/sshd",
        ]
        self.run(" && ".join(mounts), check=True)

    @staticmethod
    def _child_of(pid: int) -> int:
        children = Path(f"/proc/{pid}/task/{pid}/children")
        for _ in range(100):
            if ids := children.read_text().split():
                return int(ids[0])
            time.sleep(0.05)
        raise RuntimeError("unshare started no child")

    def _enter(self, cmd: str) -> list[str]:
        return ["nsenter", "-t", str(self.init_pid), "-n", "-p", "-m", f"--wd={REPO}", "bash", "-c", cmd]

    def run(
        self, cmd: str, timeout: float = 60, check: bool = False, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(self._enter(cmd), check=False, capture_output=True, text=True, timeout=timeout, env=env)
        if check:
            assert result.returncode == 0, f"{cmd!r} failed:\n{tail(result)}"
        return result

    def spawn(self, cmd: str, log_name: str) -> None:
        with open(self.logs / log_name, "wb") as log:
            self.track(subprocess.Popen(self._enter(cmd), stdout=log, stderr=subprocess.STDOUT))

    def track(self, proc: subprocess.Popen) -> None:
        """Wait for `proc` on close (it ends with the sandbox)."""
        self._background.append(proc)

    def running(self, names: set[str]) -> set[str]:
        return names & set(self.run("ps -eo comm=", check=True).stdout.split())

    def close(self) -> None:
        self._holder.kill()
        self._holder.wait()
        for proc in self._background:
            proc.wait(timeout=10)


def tail(result: subprocess.CompletedProcess, lines: int = 60) -> str:
    return "\n".join((result.stdout + result.stderr).splitlines()[-lines:])


def client_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{VENV_BIN}:{env['PATH']}", HOME="/root", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return {**env, **extra}


def ensure_debian_packages(tools: dict[str, str]) -> None:
    """Install the Debian package of each missing tool (tool -> package)."""
    missing = sorted({package for tool, package in tools.items() if not shutil.which(tool)})
    if not missing:
        return
    # Debian's policy-rc.d in containers keeps a package from starting its service (sshd).
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, check=False, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, env=env)
        subprocess.run(install, check=True, capture_output=True, env=env)


# RFC 2544's benchmarking range: never routed out of this machine.
BRIDGE_PREFIX = "198.18.0"
BRIDGE = "br0"

INIT_SCRIPT = """\
set -e
mount --bind /root/hosts/{name}/tmp /tmp
mount -t tmpfs -o size=4g tmpfs /dev/shm
hostname {name}
{repo_mount}
# The host's init: it reaps what Ray's daemons leave (they are reparented to it).
exec -a {marker} bash -c 'while :; do sleep 1; done'
"""


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    ip: str
    link: str  # its veth end on the bridge, in the sandbox's network namespace: faults go there
    init_pid: int  # its PID namespace's init, as this process numbers it


class BridgedHosts:
    """Hosts inside a `Sandbox`, joined by veth pairs on one bridge (the sandbox's namespace is
    the switch, at BRIDGE_PREFIX.254). Each host has its own network, PID, IPC, UTS and mount
    namespaces and its own /tmp and /dev/shm. Separate network namespaces alone are not enough:
    between processes of one kernel UCX still finds cma (process_vm_readv) and shared memory,
    and reads without touching the network; across PID and IPC namespaces it cannot, and goes
    over the link as it would between machines. Killing a host's init kills the whole host."""

    def __init__(self, box: Sandbox, names: list[str]) -> None:
        ensure_debian_packages({"nft": "nftables", "tc": "iproute2", "ss": "iproute2"})
        self.box = box
        self._token = uuid.uuid4().hex[:8]
        box.run(f"ip link add {BRIDGE} type bridge && ip addr add {BRIDGE_PREFIX}.254/24 dev {BRIDGE}", check=True)
        box.run(f"ip link set {BRIDGE} up", check=True)
        self.hosts = {name: self._start(name, f"{BRIDGE_PREFIX}.{i}") for i, name in enumerate(names, 1)}

    def _start(self, name: str, ip: str) -> Host:
        link = f"veth-{name}"[:15]  # interface names are at most 15 characters
        self.box.run(
            f"ip netns add {name} && ip link add {link} type veth peer name eth0 netns {name} && "
            f"ip link set {link} master {BRIDGE} up && ip -n {name} addr add {ip}/24 dev eth0 && "
            f"ip -n {name} link set eth0 up && ip -n {name} link set lo up",
            check=True,
        )
        directory = self.box.home / "hosts" / name
        (directory / "tmp").mkdir(parents=True)
        marker = f"pdhost-{name}-{self._token}"
        # A checkout under /tmp (as CI may clone) stays visible at its path over the host's /tmp.
        repo_mount = f"mkdir -p {REPO} && mount --bind /root/pdserve {REPO}" if REPO.is_relative_to("/tmp") else ""
        (directory / "init.sh").write_text(INIT_SCRIPT.format(name=name, marker=marker, repo_mount=repo_mount))
        self.box.spawn(
            f"ip netns exec {name} unshare --pid --fork --mount --mount-proc --ipc --uts --propagation=private "
            f"--kill-child bash /root/hosts/{name}/init.sh",
            f"host-{name}.log",
        )
        deadline = time.monotonic() + 10
        while (pid := _pid_of(marker)) is None:
            log = (self.box.logs / f"host-{name}.log").read_text()
            assert time.monotonic() < deadline, f"host {name} did not start:\n{log}"
            time.sleep(0.05)
        return Host(name, ip, link, pid)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def tmp(self, name: str) -> Path:
        """The host's /tmp, as this process sees it."""
        return self.box.home / "hosts" / name / "tmp"

    def _enter(self, name: str, cmd: str) -> list[str]:
        pid = str(self.hosts[name].init_pid)
        return ["nsenter", "-t", pid, "-n", "-p", "-m", "-i", "-u", f"--wd={REPO}", "bash", "-c", cmd]

    def run(
        self, name: str, cmd: str, timeout: float = 60, check: bool = False, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        result = subprocess.run(
            self._enter(name, cmd), check=False, capture_output=True, text=True, timeout=timeout, env=env
        )
        if check:
            assert result.returncode == 0, f"on {name}: {cmd!r} failed:\n{tail(result)}"
        return result

    def spawn(self, name: str, cmd: str, log_name: str, env: dict | None = None) -> subprocess.Popen:
        with open(self.box.logs / log_name, "wb") as log:
            proc = subprocess.Popen(self._enter(name, cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.box.track(proc)
        return proc

    # ---- faults, made in the switch (the sandbox's namespace); netem is not in this kernel ----

    def drop(self, a: str, b: str, percent: int) -> None:
        """Drop `percent`% of the packets between hosts a and b, both ways (100: a partition).
        Bridged frames pass nftables' bridge family; `numgen random` picks the share."""
        table = "bridge pdserve_faults"
        rules = [f"add table {table}", f"add chain {table} forward {{ type filter hook forward priority 0; }}"]
        share = "" if percent >= 100 else f"numgen random mod 100 < {percent} "
        for src, dst in ((a, b), (b, a)):
            rules.append(f"add rule {table} forward ip saddr {self[src].ip} ip daddr {self[dst].ip} {share}drop")
        self.box.run("nft -f - <<'EOF'\n" + "\n".join(rules) + "\nEOF", check=True)

    def cap(self, name: str, rate: str) -> None:
        """Cap what reaches host `name` over its link to `rate` (tc tbf, e.g. "1gbit")."""
        self.box.run(
            f"tc qdisc replace dev {self[name].link} root tbf rate {rate} burst 256kb latency 100ms", check=True
        )

    def heal(self) -> None:
        """Remove every drop rule and cap."""
        self.box.run("nft delete table bridge pdserve_faults 2>/dev/null; true", check=True)
        for host in self.hosts.values():
            self.box.run(f"tc qdisc del dev {host.link} root 2>/dev/null; true", check=True)

    def popen(self, name: str, cmd: str, env: dict | None = None) -> subprocess.Popen:
        """A process on host `name` whose stdin and stdout (text, line-buffered) this process holds."""
        proc = subprocess.Popen(
            self._enter(name, cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.box.logs / f"{name}-popen.log", "ab"),
            text=True,
            bufsize=1,
            env=env,
        )
        self.box.track(proc)
        return proc

    def report(self, lines: int = 25) -> str:
        """What each host runs and where its Python processes are stuck (py-spy), and the tail of
        every Ray worker log that has an error output: for a test that failed to say why."""
        spy = VENV_BIN / "py-spy"
        parts = []
        for name in self.hosts:
            logs = self.tmp(name) / "ray"
            parts.append(f"==== {name}: processes")
            parts.append(self.run(name, "ps -eo pid,etime,pcpu,rss,args --sort=-pcpu | cut -c1-160 | head -12").stdout)
            stacks = self.run(
                name, f"for p in $(pgrep -f '^ray::|pdserve serve'); do {spy} dump --nonblocking --pid $p; done", 60
            )
            parts.append(f"==== {name}: Python stacks\n{stacks.stdout[-6000:]}")
            for log in sorted(logs.glob("session_2*/logs/*.err")):
                if text := log.read_text(errors="replace").strip():
                    parts.append(f"==== {name}: {log.name}\n" + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(parts)

    def lose(self, name: str) -> None:
        """Every process of the host dies at once, as when a machine loses power."""
        os.kill(self.hosts[name].init_pid, signal.SIGKILL)


def _pid_of(argv0: str) -> int | None:
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().split(b"\0", 1)[0] == argv0.encode():
                    return int(proc.name)
            except OSError:
                continue
    return None
