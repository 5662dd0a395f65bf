"""Engine threads are confined to the engine's cores (NixlConnector moves them elsewhere)."""

import os
import subprocess
import sys

import pytest

from vllm_engine.cpu_affinity import parse_cores


def test_parse_cores_reads_vllm_bind_syntax():
    assert parse_cores("0") == {0}
    assert parse_cores("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError, match="core ids and ranges"):
        parse_cores("0|1")  # one engine per process: no per-rank lists


def test_confine_threads_moves_strays_and_keeps_bound_threads():
    # In a child process: confining changes the affinity of every thread of the process.
    code = """
import os, threading
from vllm_engine.cpu_affinity import confine_threads
ready, done = threading.Event(), threading.Event()
def bound():  # an OpenMP-style worker already bound within the engine's cores
    os.sched_setaffinity(0, {0})
    ready.set(); done.wait()
worker = threading.Thread(target=bound); worker.start(); ready.wait()
os.sched_setaffinity(0, {0, 1})  # the main thread strays, as NixlConnector leaves it
moved = confine_threads({0})
print(sorted(moved) == [os.getpid()], os.sched_getaffinity(0) == {0}, os.sched_getaffinity(worker.native_id) == {0})
late = threading.Thread(target=lambda: print(os.sched_getaffinity(0) == {0})); late.start(); late.join()
done.set(); worker.join()
"""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs a machine with at least 2 cores")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["True", "True", "True", "True"]  # moved only the stray; new threads inherit
