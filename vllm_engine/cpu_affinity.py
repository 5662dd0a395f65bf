"""Which cores a CPU engine's threads run on: its forward on the engine's own cores, its
helpers anywhere the process may run.

vLLM 0.32's NixlConnector, on CPU, moves the thread that builds it onto the last core of
each NUMA node ("reserve different cores for start_load_kv() from model_forward()"). That
assumes the forward runs on other OpenMP threads; with one core per engine the forward runs
on the calling thread itself, so every engine with a connector would share the host's last
core while the others sit idle.

So the engine's Python threads (the loop that runs the forward, and the actor's asyncio
thread, which shares its GIL) go back onto the engine's cores. Its native helper threads do
not: NIXL's progress thread and Ray's I/O threads wake on traffic, and pinned beside the
forward every wake-up would preempt it. Python threads stay with the forward on purpose: on
another core they would take the GIL from it mid-step.
"""

from __future__ import annotations

import os
import threading

_process_cores: frozenset[int] | None = None


def parse_cores(spec: str) -> set[int]:
    """VLLM_CPU_OMP_THREADS_BIND syntax for one engine: "0", "2-3", "0,2-3"."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"cpu_cores {spec!r}: expected core ids and ranges such as '0' or '0,2-3'")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def remember_process_cores() -> None:
    """Record the cores this process may run on, before vLLM binds any thread (first call wins)."""
    global _process_cores
    if _process_cores is None:
        _process_cores = frozenset(os.sched_getaffinity(0))


def process_cores() -> set[int]:
    """Where helper threads may run: the process's cores as first recorded (now, if never)."""
    remember_process_cores()
    assert _process_cores is not None
    return set(_process_cores)


def thread_ids() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/task")}


def python_thread_ids() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def confine_python_threads(cores: set[int]) -> list[int]:
    """Move each Python thread of this process that may run outside `cores` onto `cores`
    (native threads keep their binding: OpenMP workers stay on theirs, helpers stay free).
    Returns the thread ids moved."""
    return _set_affinity(python_thread_ids(), cores, only_outside=True)


def free_threads(tids: set[int]) -> list[int]:
    """Let these (native helper) threads run on any of the process's cores."""
    return _set_affinity(tids, process_cores(), only_outside=False)


def _set_affinity(tids: set[int], cores: set[int], only_outside: bool) -> list[int]:
    moved = []
    for tid in sorted(tids):
        try:
            current = os.sched_getaffinity(tid)
            if current != cores and not (only_outside and current <= cores):
                os.sched_setaffinity(tid, cores)
                moved.append(tid)
        except (ProcessLookupError, PermissionError):  # a thread that exited meanwhile
            continue
    return moved
