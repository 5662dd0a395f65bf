"""The controller: one detached Ray actor that owns the engine pools.

It starts the engines (so they belong to it, not to any router: a router that dies takes
no engine with it), polls their health and load, pre-warms NIXL handshakes, resizes and
drains, and publishes a `ClusterView` that every router mirrors. The engines are detached:
a controller that is killed or crashes is restarted by Ray and adopts them from its
checkpoint (controller/checkpoint.py), while the routers route on its last view. Routers are stateless
request paths that come and go (router/actor.py). With a planner it also changes the split
as the traffic the routers report shifts (controller/planning.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from controller.admission_grants import AdmissionGrants
from controller.checkpoint import GcsRecord
from controller.deployment import Deployment, DeploymentConfig
from kv_transfer.link_probe import LinkMeasurement
from controller.planning import PlannerSetup, PlanningLoop
from messages.membership import ClusterView, MemberState, RouterReport, ScalingDecision, ScalingOutcome
from cluster.pools import Member
from cluster.prometheus_targets import write_targets

log = logging.getLogger(__name__)

# One controller per Ray cluster (namespace "pdserve"): a `pdserve serve` that finds it
# running (its predecessor was killed) serves its pools instead of starting new engines.
CONTROLLER_NAME = "pdserve-controller"


def _state(member: Member) -> MemberState:
    return MemberState(member.name, member.actor, member.lifecycle, member.load, member.capacity)


@ray.remote(num_cpus=0, max_concurrency=64)
class PoolController:
    def __init__(
        self,
        config: DeploymentConfig,
        recovery_key: str,
        health_interval_s: float = 0.5,
        prometheus_sd_file: str | None = None,
        planner: PlannerSetup | None = None,
    ) -> None:
        """`recovery_key`: where this controller, and any Ray restarts in its place, keep their
        checkpoint (unique per controller)."""
        from prometheus_client import start_http_server

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        if planner is not None and config.num_prefill == 0:
            raise ValueError("the planner moves engines between prefill and decode: serve with --prefill >= 1")
        self._deployment = Deployment(config, recovery_key)
        self._routers = GcsRecord(f"{recovery_key}/routers")
        self._health_interval_s = health_interval_s
        self._sd_file = Path(prometheus_sd_file) if prometheus_sd_file else None
        self._planner_setup = planner
        self.planning: PlanningLoop | None = None
        host = ray.util.get_node_ip_address()
        server, _ = start_http_server(0, addr=host)  # planner and pool metrics
        self._targets: dict[str, tuple[str, str]] = {"controller": ("controller", f"{host}:{server.server_port}")}
        self._tasks: list[asyncio.Task[None]] = []
        self._resizing = asyncio.Lock()
        self._admission = AdmissionGrants()  # the router tier's in-flight and queue limits, shared out
        self._started = False
        context = ray.get_runtime_context()
        with warnings.catch_warnings():  # Ray's own call of its deprecated actor_id
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = context.was_current_actor_reconstructed
        # Nobody calls start() on a controller Ray restarted: the first view request (the
        # routers ask every health interval) starts the adoption.
        self._adopt_on_first_view = restarted
        if restarted:
            log.warning("controller restarted: it adopts its engines on the first view request")
            for name, address in (self._routers.load() or {}).items():
                self._targets[name] = ("router", address)

    async def start(self, adopt: bool = False) -> ClusterView:
        """Start every engine (`adopt`: take over the running ones the checkpoint lists),
        handshake every pair, then keep polling them (and planning)."""
        if self._started:
            raise RuntimeError("the controller is started already")
        self._started = True
        await self._deployment.start(adopt)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._watch()))
        if self._planner_setup is not None:
            from planner.closed_loop import ClosedLoopPlanner

            setup = self._planner_setup
            planner = ClosedLoopPlanner(setup.config, setup.model)
            self.planning = PlanningLoop(planner, self._split, self.resize)
            self._tasks.append(loop.create_task(self.planning.run(setup.config.interval_s)))
        return await self.view()

    def _split(self) -> tuple[int, int]:
        dep = self._deployment
        return len(dep.prefill.staying), len(dep.decode.staying)

    def planner_log(self, since: int = 0) -> list[str]:
        """The planner's decisions and split changes (a line each), from line `since` on."""
        return self.planning.log_lines[since:] if self.planning is not None else []

    async def _adopt(self) -> None:
        try:
            await self.start(adopt=True)
        except Exception:  # crash-only: Ray restarts this controller, which tries again
            log.exception("adopting the engines failed: exiting for a restart")
            os._exit(70)

    async def view(self, report: RouterReport | None = None) -> ClusterView:
        """The pools as they are; a router hands over what it saw since it last asked."""
        if self._adopt_on_first_view:
            self._adopt_on_first_view = False
            self._tasks.append(asyncio.get_running_loop().create_task(self._adopt()))
        if report is not None and self.planning is not None:
            self.planning.add(report)
        dep = self._deployment
        if dep.orchestrator is None or dep.limits is None:  # its engines are not all handshaken yet
            raise RuntimeError("the controller is still starting its engines")
        admission = report.admission if report is not None else None
        return ClusterView(
            tuple(_state(m) for m in dep.prefill.members),
            tuple(_state(m) for m in dep.decode.members),
            dep.limits,
            dep.health.polls,
            self._admission.grant(admission, time.monotonic()) if admission is not None else None,
        )

    def links(self) -> list[LinkMeasurement]:
        """Each prefill/decode pair's start-up READ."""
        return self._deployment.links

    def capacities(self) -> dict[str, str]:
        return {name: capacity.summary() for name, capacity in self._deployment.capacities.items()}

    async def resize(self, decision: ScalingDecision) -> ScalingOutcome:
        """One resize at a time, whoever asked (the planner, a router's Admin.ScalePools)."""
        if self._resizing.locked():
            raise RuntimeError("a resize is already in progress: retry when it is done")
        async with self._resizing:
            return await self._deployment.resize(decision)

    def register_router(self, name: str, metrics_address: str | None) -> None:
        """A router's metrics endpoint, listed beside the engines' for Prometheus."""
        if metrics_address:
            self._targets[name] = ("router", metrics_address)
        else:
            self._targets.pop(name, None)
        self._save_routers()

    def router_left(self, name: str) -> None:
        """A router drained: no metrics to scrape, no share of admission to hold."""
        self._targets.pop(name, None)
        self._admission.forget(name)
        self._save_routers()

    def _save_routers(self) -> None:
        self._routers.save({name: address for name, (kind, address) in self._targets.items() if kind == "router"})

    def shutdown(self) -> None:
        """Stop polling (and planning) and kill every engine (the caller then kills this actor)."""
        for task in self._tasks:
            task.cancel()
        self._deployment.shutdown()
        self._routers.remove()

    async def _watch(self) -> None:
        dep = self._deployment
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await dep.health.refresh(poll_timeout_s=max(1.0, 4 * self._health_interval_s))
                if self._sd_file is not None:
                    write_targets(self._sd_file, (dep.prefill, dep.decode), self._targets)
            except Exception:  # keep watching; a failed poll marks members dead
                log.exception("pool health poll failed")


def controller_for(
    config: DeploymentConfig,
    name: str = CONTROLLER_NAME,
    prometheus_sd_file: str | None = None,
    planner: PlannerSetup | None = None,
) -> tuple[Any, bool]:
    """The running controller called `name`, or a new detached one (not yet started): it
    outlives whoever created it and every router, until `shutdown()` and `ray.kill`; Ray
    restarts it as often as it dies (as Ray Serve's controller), and each restart adopts the
    engines. Returns (handle, created)."""
    try:
        return ray.get_actor(name), False
    except ValueError:
        pass
    # On the node `serve` runs on (the head, beside the routers), not on a random node (where
    # Ray puts an actor that needs no resources, soft affinity included): on an engine's node,
    # losing that node would take the controller, and with it every engine it owns. It needs
    # no resources, so that node always has room.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    handle = PoolController.options(name=name, lifetime="detached", scheduling_strategy=here, max_restarts=-1)
    key = uuid.uuid4().hex[:8]  # names its engines and checkpoint
    return handle.remote(config, key, prometheus_sd_file=prometheus_sd_file, planner=planner), True
