"""Layering: benchmarks depend on the product, never the other way round."""

import subprocess
import sys


def test_product_packages_never_import_bench():
    code = (
        "import sys, router.cli, router.server, planner.cli, planner.probe, planner.trace, vllm_engine.plan_cli; "
        "print(sorted(m for m in sys.modules if m == 'bench' or m.startswith('bench.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
