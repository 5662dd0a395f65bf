"""Every engine process may use AMX tiles where the CPU has them (vllm_engine.vllm_plugin).

Linux gives a process the tile state only after it asks; vLLM's CPU attention kernel uses
AMX without asking, and a decode engine whose first step after a handoff reached it died of
SIGILL. The model matrix's P/D tests are that failure end to end on an AMX host; this checks
the request itself, in a fresh process, on any x86-64 host."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, torch
ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1022, 18, 158
libc = ctypes.CDLL(None, use_errno=True)

def tiles_allowed():
    mask = ctypes.c_uint64()
    assert libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)

before = tiles_allowed()
from vllm_engine.vllm_plugin import register
register()
print(torch.cpu._is_amx_tile_supported(), before, tiles_allowed())
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX and arch_prctl are x86-64's")
def test_the_plugin_asks_for_amx_tiles_exactly_where_the_cpu_has_them():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    has_amx, before, after = out.stdout.split()[-3:]
    assert before == "False", "a fresh process already had the tiles: this test no longer sees the request"
    assert after == has_amx
