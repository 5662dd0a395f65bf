"""Servers a benchmark starts, and stops whatever ends the benchmark.

Each server runs in a session of its own, so a Ctrl-C meant for the benchmark does not reach
it half-way through a measurement; the benchmark stops it, with its whole process group (a
`pdserve serve` and its Ray cluster, a vLLM server and its engine core), from a `finally`.
A SIGTERM would end the benchmark without running those: the first server started makes
SIGTERM raise SystemExit instead, and at exit every server not stopped yet is stopped (a
signal can land between a server's start and the `try` that would stop it).
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import IO, Sequence


class ServerProcess:
    def __init__(
        self,
        command: Sequence[str],
        log: IO[str] | IO[bytes] | int = subprocess.DEVNULL,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """`log`: where its stdout and stderr go (a file, or subprocess.DEVNULL)."""
        _exit_on_sigterm()
        self._process = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
            preexec_fn=_default_sigint,
        )
        _running.add(self)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def exited(self) -> bool:
        return self._process.poll() is not None

    def wait(self, timeout_s: float) -> int:
        """Its exit status; subprocess.TimeoutExpired if it still runs after `timeout_s`."""
        return self._process.wait(timeout_s)

    def stop(self, sig: signal.Signals = signal.SIGINT, timeout_s: float = 60) -> None:
        stop_all([self], sig, timeout_s)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:  # the group is gone already
            pass

    def _wait_or_kill(self, timeout_s: float) -> None:
        try:
            self.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self._process.wait()


def stop_all(servers: Sequence[ServerProcess], sig: signal.Signals = signal.SIGINT, timeout_s: float = 60) -> None:
    """Signal every server's group at once (`sig`: the one it shuts down cleanly on), then wait
    for each; a group still there after `timeout_s` is killed."""
    for server in servers:
        if not server.exited:
            server._signal_group(sig)
    for server in servers:
        server._wait_or_kill(timeout_s)
        _running.discard(server)


# Started and not stopped yet: what the exit hook stops.
_running: set[ServerProcess] = set()


@atexit.register
def _stop_the_rest() -> None:
    stop_all(list(_running), timeout_s=30)


def _default_sigint() -> None:
    """In the server's process before it starts: SIGINT, the signal it is stopped with, at its
    default. A benchmark started in the background by a shell, or by a pytest-xdist worker,
    ignores SIGINT, and an ignored signal stays ignored across exec: the server would then
    run on until killed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _exit_on_sigterm() -> None:
    """SIGTERM -> SystemExit(143) in this process, unless it already handles SIGTERM (only the
    main thread may install a handler)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
