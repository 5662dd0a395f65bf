"""The router tier of `pdserve serve`: N router actors in front of one controller, kept at N.

Routers on one host share the gRPC (and HTTP) port: the first binds the configured
address, the others the port it got. Each has a slot: slot i serves its metrics on
--metrics-port + i. A router that dies is replaced in its slot by a new one; the other
routers' streams are not touched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

import ray

from router.actor import RouterActor, RouterAddresses, RouterSettings
from cluster.ray_cluster import ROUTER_RESOURCE

log = logging.getLogger(__name__)


class RouterTier:
    def __init__(
        self,
        controller: Any,
        settings: RouterSettings,
        check_interval_s: float = 2.0,
        placement_timeout_s: float = 120.0,
    ) -> None:
        self._controller = controller
        self._settings = settings
        self._check_interval_s = check_interval_s
        self._placement_timeout_s = placement_timeout_s
        # Where routers may run: the nodes with router slots, else anywhere.
        slotted = ray.cluster_resources().get(ROUTER_RESOURCE, 0) > 0
        self._placement: dict[str, Any] = {"resources": {ROUTER_RESOURCE: 1}} if slotted else {}
        self.routers: dict[int, tuple[Any, RouterAddresses]] = {}  # slot -> actor, addresses
        self._names: dict[int, str] = {}  # slot -> the router's name, as the controller knows it
        self._started = 0
        self._watch: asyncio.Task[None] | None = None

    async def start(self, count: int) -> list[RouterAddresses]:
        if count < 1:
            raise ValueError(f"--routers {count}: at least one router must take traffic")
        self._settings = dataclasses.replace(self._settings, tier_size=count)
        first = await self._add(0)
        # The others bind the ports the first one got (a listen port of 0 picks a free one).
        self._settings = dataclasses.replace(self._settings, listen=first.grpc, http=first.http)
        await asyncio.gather(*(self._add(slot) for slot in range(1, count)))
        self._watch = asyncio.get_running_loop().create_task(self._keep_count())
        return [self.routers[slot][1] for slot in sorted(self.routers)]

    async def _add(self, slot: int) -> RouterAddresses:
        s = self._settings
        settings = dataclasses.replace(s, metrics_port=s.metrics_port + slot) if s.metrics_port else s
        name = f"router-{self._started}"
        self._started += 1
        actor = RouterActor.options(
            name=f"pdserve-{name}-{uuid.uuid4().hex[:6]}", scheduling_strategy="SPREAD", **self._placement
        ).remote(name, self._controller, settings)
        try:
            addresses = await asyncio.wait_for(actor.serve.remote(), self._placement_timeout_s)
        except TimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(
                f"{name} did not start within {self._placement_timeout_s:.0f}s: are there {ROUTER_RESOURCE} slots "
                f"for every router (`ray status`)? Run fewer --routers or declare more slots"
            ) from None
        self.routers[slot] = (actor, addresses)
        self._names[slot] = name
        log.info("%s serves gRPC on %s", name, addresses.grpc)
        return addresses

    async def _keep_count(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval_s)
            for slot in range(self._settings.tier_size):
                if slot in self.routers:
                    try:
                        await asyncio.wait_for(self.routers[slot][0].pid.remote(), 10)
                        continue
                    except (ray.exceptions.RayActorError, TimeoutError):
                        log.warning("router in slot %d is gone: starting one in its place", slot)
                        del self.routers[slot]
                        await self._forget(self._names.pop(slot))
                try:  # a slot whose last start failed is tried again here
                    await self._add(slot)
                except Exception:
                    log.exception("could not start a router in slot %d; retrying", slot)

    async def _forget(self, name: str) -> None:
        """A dead router drained nothing: tell the controller it left, so its admission share
        is free now (not when it expires) and its metrics target is no longer listed."""
        try:
            await asyncio.wait_for(self._controller.router_left.remote(name), 10)
        except Exception as err:  # restarting: the share still expires, the target stays listed
            log.warning("could not tell the controller that %s left: %r", name, err)

    async def drain(self, timeout_s: float) -> bool:
        """Every router stops admitting and lets its streams finish; True if all did in time."""
        if self._watch is not None:
            self._watch.cancel()
        finished = await asyncio.gather(
            *(actor.drain.remote(timeout_s) for actor, _ in self.routers.values()), return_exceptions=True
        )
        for actor, _ in self.routers.values():
            ray.kill(actor, no_restart=True)
        self.routers.clear()
        return all(f is True for f in finished)
