"""Engines share one torch.compile cache key (vllm_engine.vllm_plugin): vLLM hashes every VLLM_*
variable into it, NIXL's side-channel port and the CPU core binding included, which differ per
engine and change nothing compiled."""

from __future__ import annotations

import pytest


@pytest.fixture
def compile_factors(monkeypatch):
    import vllm.envs as envs

    from vllm_engine.vllm_plugin import _share_compile_cache_key

    monkeypatch.setattr(envs, "compile_factors", envs.compile_factors)  # undone after the test
    _share_compile_cache_key()

    def factors(port: str, cores: str) -> dict[str, object]:
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", port)
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cores)
        return envs.compile_factors()

    return factors


def test_engines_on_other_ports_and_cores_share_the_key(compile_factors):
    first, second = compile_factors("5600", "0|1"), compile_factors("5731", "2|3")
    assert first == second
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in first and first["VLLM_CPU_OMP_THREADS_BIND"] == "1|1"


def test_a_binding_of_more_cores_keys_apart(compile_factors):
    # Inductor may generate other code for another thread count.
    assert compile_factors("5600", "0-3")["VLLM_CPU_OMP_THREADS_BIND"] == "4"
    assert compile_factors("5600", "0,2-3|4")["VLLM_CPU_OMP_THREADS_BIND"] == "3|1"
