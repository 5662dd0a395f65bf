"""Layering: which packages a module pulls in, checked in a fresh interpreter."""

import subprocess
import sys


def packages_loaded_by(modules: str) -> set[str]:
    """Top-level packages in sys.modules after importing `modules` (comma-separated)."""
    code = f"import sys, {modules}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_product_packages_never_import_bench():
    """Benchmarks depend on the product, never the other way round."""
    product = "router.cli, router.server, planner.cli, planner.probe, planner.trace, vllm_engine.plan_cli"
    assert "bench" not in packages_loaded_by(product)


def test_sizing_imports_no_heavy_packages():
    """`pdserve plan` answers from config.json alone: no vLLM, torch or Ray."""
    assert not packages_loaded_by("vllm_engine.sizing") & {"vllm", "torch", "ray"}


def test_messages_import_no_engine_or_cluster_packages():
    """Every process shares the messages; none should pay for vLLM, torch or Ray to name one."""
    loaded = packages_loaded_by(
        "messages.requests, messages.results, messages.reports, messages.transfer, messages.timings, messages.errors"
    )
    assert not loaded & {"vllm", "torch", "ray", "numpy"}, loaded


def test_the_routers_request_path_imports_no_vllm():
    routers = "router.server, router.orchestrator, router.openai_http, router.actor, router.tier, router.mirror"
    assert not packages_loaded_by(routers) & {"vllm", "torch"}
