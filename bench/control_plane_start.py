"""How fast the control plane comes up, beside what loading an engine's packages costs.

One run on a private Ray cluster: a controller starting 1P+1D (until its engines are
handshaken), then routers joining it, one and then two at once (created until serving),
each repeated. Beside them, a fresh process importing vLLM's engine as every router and
controller process did while the worker modules loaded vLLM (vllm_engine/stat_logger.py says
why they no longer do). Prints medians and the ratio of a router's start to that import.

    python -m bench.control_plane_start [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import uuid

import ray

from cluster.ray_cluster import start_local
from controller.actor import controller_for
from controller.deployment import DeploymentConfig
from router.actor import RouterActor, RouterSettings
from vllm_engine.config import EngineConfig, resolve_model


IMPORT = "import vLLM's engine"


def _import_vllm_s() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import vllm.v1.engine.llm_engine"], check=True, capture_output=True)
    return time.monotonic() - started


def _routers_s(controller, model: str, count: int, tag: str) -> float:
    settings = RouterSettings(model=model, listen="127.0.0.1:0", metrics_port=0, tier_size=count)
    started = time.monotonic()
    actors = [RouterActor.remote(f"{tag}-{i}", controller, settings) for i in range(count)]
    ray.get([actor.serve.remote() for actor in actors])
    seconds = time.monotonic() - started
    for i, actor in enumerate(actors):
        ray.kill(actor, no_restart=True)
        ray.get(controller.router_left.remote(f"{tag}-{i}"))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    start_local()
    model = resolve_model(EngineConfig().model)
    config = DeploymentConfig(engine=EngineConfig(model=model))
    controller, _ = controller_for(config, f"bench-controller-{uuid.uuid4().hex[:6]}")
    started = time.monotonic()
    ray.get(controller.start.remote())
    controller_s = time.monotonic() - started
    print(f"controller with 1P+1D handshaken: {controller_s:.1f} s", flush=True)
    rows: dict[str, list[float]] = {"1 router": [], "2 routers at once": [], IMPORT: []}
    for rep in range(args.reps):
        rows["1 router"].append(_routers_s(controller, model, 1, f"one-{rep}"))
        rows["2 routers at once"].append(_routers_s(controller, model, 2, f"two-{rep}"))
        rows[IMPORT].append(_import_vllm_s())
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    ray.get(controller.shutdown.remote())
    medians = {name: statistics.median(values) for name, values in rows.items()}
    print(f"\n{'':24} median (s)")
    for name, median in medians.items():
        print(f"{name:24} {median:10.2f}")
    print(f"a router's start: {medians['1 router'] / medians[IMPORT]:.2f}x the vLLM import it no longer pays")


if __name__ == "__main__":
    main()
