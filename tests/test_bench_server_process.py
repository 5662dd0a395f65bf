"""bench/server_process.py: a server a benchmark started does not outlive the benchmark."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.server_process import ServerProcess

# A benchmark terminated where the worst timing would catch it: after starting a server and
# before any `try` that would stop it (the bench modules stop theirs from a `finally`).
_BENCH = """
import sys, time
from bench.server_process import ServerProcess
server = ServerProcess([sys.executable, "-c", "import time; time.sleep(120)"])
print(server.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_terminated_benchmark_stops_its_servers():
    root = Path(__file__).resolve().parent.parent
    bench = subprocess.Popen([sys.executable, "-c", _BENCH], stdout=subprocess.PIPE, text=True, cwd=root)
    server_pid = int(bench.stdout.readline())
    try:
        assert _running(server_pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _running(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(server_pid), "the server outlived the benchmark that started it"
    finally:
        bench.kill()
        if _running(server_pid):
            os.killpg(server_pid, signal.SIGKILL)


def test_a_server_that_ignores_its_signal_is_killed(tmp_path: Path):
    ready = tmp_path / "ready"
    deaf = "import signal, sys, time; signal.signal(2, signal.SIG_IGN); open(sys.argv[1], 'w'); time.sleep(99)"
    server = ServerProcess([sys.executable, "-c", deaf, str(ready)])
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    server.stop(signal.SIGINT, timeout_s=1)
    assert time.monotonic() - started < 10
    assert server.wait(1) == -signal.SIGKILL
