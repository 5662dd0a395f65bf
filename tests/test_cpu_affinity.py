"""An engine's Python threads keep to its cores (NixlConnector moves them elsewhere); its
native helper threads may run on any of the process's cores."""

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


def test_python_threads_join_the_engine_and_native_helpers_run_anywhere():
    # In a child process (placement changes every thread of the process), on cores {0, 1}:
    # Python threads move onto the engine's core 0 unless already bound within it; a thread
    # that `threading` does not know (as NIXL's and Ray's native threads) is left alone by
    # that, and `free_threads` lets it run on all the process's cores again.
    code = """
import _thread, os, threading
from vllm_engine.cpu_affinity import confine_python_threads, free_threads, remember_process_cores
os.sched_setaffinity(0, {0, 1})
remember_process_cores()
ready, done = threading.Event(), threading.Event()
def bound():  # a Python thread already bound within the engine's cores
    os.sched_setaffinity(0, {0})
    ready.set(); done.wait()
worker = threading.Thread(target=bound); worker.start(); ready.wait()
helper_id, helper_ready = [], threading.Event()
def native():  # pinned beside the forward, as a thread inheriting a bound creator's cores
    os.sched_setaffinity(0, {0}); helper_id.append(threading.get_native_id()); helper_ready.set(); done.wait()
_thread.start_new_thread(native, ()); helper_ready.wait()
moved = confine_python_threads({0})
print(moved == [os.getpid()], os.sched_getaffinity(0) == {0}, os.sched_getaffinity(worker.native_id) == {0})
print(os.sched_getaffinity(helper_id[0]) == {0}, free_threads(set(helper_id)) == helper_id)
print(os.sched_getaffinity(helper_id[0]) == {0, 1})
late = threading.Thread(target=lambda: print(os.sched_getaffinity(0) == {0})); late.start(); late.join()
done.set(); worker.join()
"""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs a machine with at least 2 cores")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["True"] * 7  # moved only the stray Python thread; new threads inherit
