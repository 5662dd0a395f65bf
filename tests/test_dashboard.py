"""The example Grafana dashboard only plots metrics the code exports."""

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana-dashboard.json"


def test_dashboard_queries_exported_metrics():
    from prometheus_client import REGISTRY

    import kv_transfer.metrics  # noqa: F401  (registers the worker metrics)
    import router.metrics  # noqa: F401

    exported = {sample_name for family in REGISTRY.collect() for sample_name in _sample_names(family)}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"pdserve_\w+", target["expr"])
    }
    assert queried, "dashboard has no pdserve queries"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def _sample_names(family) -> set[str]:
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "gauge": ("",)}
    return {family.name + s for s in suffixes.get(family.type, ("",))}


def test_every_grouping_names_distinct_labels():
    """`sum by (le, le)` is what the NIXL bandwidth panel once asked for."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for labels in re.findall(r"by \(([^)]*)\)", target["expr"]):
                names = [name.strip() for name in labels.split(",")]
                assert len(names) == len(set(names)), (panel["title"], target["expr"])
