"""What pdserve's vLLM plugin sets up in every engine process (vllm_engine.vllm_plugin), seen
in a fresh process after `register()`, as vLLM runs it.

- AMX tiles, where the CPU has them: Linux gives a process the tile state only after it
  asks; vLLM's CPU attention kernel uses AMX without asking, and a decode engine whose first
  step after a handoff reached it died of SIGILL. The model matrix's P/D tests are that
  failure end to end on an AMX host; this checks the request on any x86-64 host.
- The sampler's logprob-rank op, eager on CPU: vLLM compiles it on first use, inside the
  first logprobs request's time to first token.
- Decoding keeps a hybrid's last state checkpoints, not one at every block end.
- The process's gloo groups share one device, so one TCP loop thread, not one per group."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, os, sys, torch
ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1022, 18, 158
libc = ctypes.CDLL(None, use_errno=True)

def tiles_allowed():
    mask = ctypes.c_uint64()
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)

before = tiles_allowed()
from vllm_engine.config import EngineConfig
from vllm_engine.vllm_plugin import register
if sys.argv[1] == "engine":
    os.environ.update(EngineConfig().process_env())  # as an engine actor sets it before vLLM starts
register()
import vllm.v1.sample.sampler as sampler
rank = sampler.batched_count_greater_than
x = torch.tensor([[0.5, -1.0, 2.0, 0.1]])
compiled = hasattr(rank, "_torchdynamo_orig_callable")
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
import tempfile, torch.distributed as dist
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
groups = [dist.new_group([0], backend="gloo") for _ in range(3)]  # vLLM's: one per dimension
total = torch.ones(1)
for group in groups:
    dist.all_reduce(total, group=group)
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
loops = [name for name in names if name == "gloo_tcp_loop"]
print(json.dumps({
    "gloo_groups": 1 + len(groups), "gloo_loop_threads": len(loops), "gloo_sum": total.item(),
    "rolls_decode_checkpoints": getattr(MambaManager.cache_blocks, "keeps_last_decode_checkpoints", False),
    "has_amx": torch.cpu._is_amx_tile_supported(), "tiles_before": before, "tiles_after": tiles_allowed(),
    "rank_compiled": compiled, "ranks": None if compiled else rank(x, x[:, :1]).tolist(),
}))
"""


def _probe(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def process() -> dict:
    """A pdserve engine's process."""
    return _probe("engine")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX and arch_prctl are x86-64's")
def test_the_plugin_asks_for_amx_tiles_exactly_where_the_cpu_has_them(process):
    assert not process["tiles_before"], "a fresh process already had the tiles: this test no longer sees the request"
    assert process["tiles_after"] == process["has_amx"]


def test_the_sampler_ranks_logprobs_eagerly_on_cpu(process):
    assert not process["rank_compiled"]
    assert process["ranks"] == [2]  # 0.5 is beaten by 2.0 and itself (vLLM counts >=)


def test_an_engine_keeps_only_its_last_decode_checkpoints(process):
    """vllm_engine.decode_checkpoints, in the process that schedules (tests/test_decode_checkpoints.py
    checks what it keeps on a real engine)."""
    assert process["rolls_decode_checkpoints"]


def test_another_vllm_process_keeps_vllms_compiled_rank_op():
    """A stock vLLM server started from this environment (the benchmarks' baseline) runs the
    plugin too, and stays stock: its rank op and its decode checkpoints."""
    stock = _probe("stock")
    assert stock["rank_compiled"] and not stock["rolls_decode_checkpoints"]
    assert stock["gloo_loop_threads"] == stock["gloo_groups"]


def test_an_engines_gloo_groups_share_one_device_and_work(process):
    """One TCP loop thread (each wakes every 10 ms) for all the process's groups, which still
    reduce (tests/test_tensor_parallel.py's TP 2 engines run vLLM's collectives across ranks)."""
    assert process["gloo_groups"] == 4 and process["gloo_loop_threads"] == 1
    assert process["gloo_sum"] == 1.0
