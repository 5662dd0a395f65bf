"""Keep every thread of a CPU engine's process on the engine's own cores.

vLLM 0.32's NixlConnector, on CPU, moves the thread that builds it onto the last core of
each NUMA node ("reserve different cores for start_load_kv() from model_forward()"). That
assumes the forward runs on other OpenMP threads; with one core per engine the forward runs
on the calling thread itself, so every engine with a connector ended up on the same last
core: a prefill engine and a decode engine on a 2-core box shared core 1 (each prefill took
twice as long while decode ran) and core 0 sat idle. Called after the engine is built,
before its loop thread starts (new threads inherit the creating thread's affinity).
"""

from __future__ import annotations

import os


def parse_cores(spec: str) -> set[int]:
    """VLLM_CPU_OMP_THREADS_BIND syntax for one engine: "0", "2-3", "0,2-3"."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"cpu_cores {spec!r}: expected core ids and ranges such as '0' or '0,2-3'")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def confine_threads(cores: set[int]) -> list[int]:
    """Move each thread of this process that may run outside `cores` onto `cores`; threads
    already within them (OpenMP workers bound one per core) keep their binding. Returns the
    thread ids moved."""
    moved = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            if not os.sched_getaffinity(tid) <= cores:
                os.sched_setaffinity(tid, cores)
                moved.append(tid)
        except (ProcessLookupError, PermissionError):  # a thread that exited meanwhile
            continue
    return moved
