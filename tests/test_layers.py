"""Layering: packages import only the layers below them, and no module pulls in more than it needs."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top to bottom; a package may import packages of lower layers only (docs/architecture.md).
LAYERS: list[tuple[str, ...]] = [
    ("deploy",),  # cluster launch and the GPU smoke test, on top of the command line
    ("cli",),  # entry points: bring up, drive and measure a deployment
    ("controller",),  # owns the pools: engine lifecycle, health, resize, the planner loop
    ("router",),  # the request path: front doors, admission, picking, orchestration
    ("planner",),  # performance model, simulator, search, closed loop (no I/O)
    ("cluster",),  # Ray bootstrap, pool membership, Prometheus discovery
    ("decode_worker",),
    ("prefill_worker",),
    ("vllm_engine",),  # how an engine is built and driven per device, sizing
    ("kv_transfer",),  # connector configuration, state layout, transfer accounting
    ("messages", "proto"),  # what crosses a process boundary
    ("configuration",),  # the config tree's machinery: knobs, parsers, generated flags and docs
]
LAYER_OF = {package: depth for depth, packages in enumerate(LAYERS) for package in packages}


def imported_packages(package: str) -> dict[str, set[str]]:
    """Product packages each module of `package` imports (any import statement, lazy ones too)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in LAYER_OF and top != package:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_product_package_has_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} | {"controller", "deploy"}
    assert packages - {"tests", "bench"} == set(LAYER_OF), "add the new package to LAYERS"


def test_no_package_imports_its_own_layer_or_one_above():
    """Fails on any upward or sideways import, hence on any circle between packages."""
    wrong = [
        f"{module} ({LAYER_OF[package]}) imports {target} ({LAYER_OF[target]})"
        for package in LAYER_OF
        for target, modules in imported_packages(package).items()
        if LAYER_OF[target] <= LAYER_OF[package]
        for module in sorted(modules)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_catches_an_upward_import(tmp_path, monkeypatch):
    """Negative control: a module of kv_transfer importing router is reported."""
    fake = tmp_path / "kv_transfer"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from router.server import RouterServer\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert imported_packages("kv_transfer") == {"router": {"kv_transfer/bad.py"}}


def packages_loaded_by(modules: str) -> set[str]:
    """Top-level packages in sys.modules after importing `modules` (comma-separated)."""
    code = f"import sys, {modules}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_product_packages_never_import_bench():
    """Benchmarks depend on the product, never the other way round."""
    product = "cli.main, router.server, planner.cli, cli.probe, planner.trace, vllm_engine.plan_cli"
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


def test_the_control_plane_loads_the_worker_classes_without_vllm():
    """Ray imports an actor's class wherever its handle arrives: routers and the controller
    import the worker modules, and an engine's packages there would cost each of them seconds
    of start-up (vLLM and torch: about 7 s on the test box) and hundreds of MB."""
    workers = "decode_worker.actor, prefill_worker.actor, decode_worker.either_role, controller.actor"
    assert not packages_loaded_by(workers) & {"vllm", "torch", "transformers"}
