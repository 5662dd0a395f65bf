"""Bring up the prefill and decode pools as Ray actors and wire them to an orchestrator."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import ray

from decode_worker.actor import DecodeActor
from kv_transfer.connector_config import TransferConfig
from prefill_worker.actor import PrefillActor
from router.orchestrator import Orchestrator, RouterPolicy
from router.pools import Member, Pool
from router.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE
from vllm_engine.config import EngineConfig
from vllm_engine.requests import ModelLimits


def default_cpu_cores() -> tuple[str, ...] | None:
    """One core per engine on CPU machines (engines bind their OpenMP threads to it)."""
    return tuple(str(c) for c in sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    num_prefill: int = 1  # 0: colocated serving (decode engines prefill themselves, no transfer)
    num_decode: int = 1
    policy: RouterPolicy = field(default_factory=RouterPolicy)
    gpus_per_engine: float = 0.0  # 0 on CPU machines
    # Ray restarts a crashed actor this many times (a new engine, new NIXL identity).
    max_restarts: int = 3
    # CPU machines: cores handed to engines in turn (prefill first). None: no pinning.
    cpu_cores: tuple[str, ...] | None = field(default_factory=default_cpu_cores)

    def engine_for(self, index: int) -> EngineConfig:
        if not self.cpu_cores or self.gpus_per_engine:
            return self.engine
        return self.engine.with_cores(self.cpu_cores[index % len(self.cpu_cores)])


class Deployment:
    """Owns the actors it started; `shutdown()` kills them all (no zombie actors)."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")
        self.limits: ModelLimits | None = None
        self.orchestrator: Orchestrator | None = None
        self._started = 0  # engines started so far: CPU cores are handed out in turn
        self._named = {"prefill": 0, "decode": 0}  # actor names are never reused

    async def start(self) -> Orchestrator:
        cfg = self.config
        self._add(self.prefill, cfg.num_prefill)
        self._add(self.decode, cfg.num_decode)
        members = self.prefill.members + self.decode.members
        await asyncio.gather(*(m.actor.ready.remote() for m in members))
        self.limits = await members[0].actor.model_limits.remote()
        self.orchestrator = Orchestrator(self.prefill, self.decode, self.limits, cfg.policy)
        await self.orchestrator.refresh(poll_timeout_s=60)  # handshakes every pair before any traffic
        return self.orchestrator

    async def resize(self, num_prefill: int, num_decode: int, drain_timeout_s: float = 300.0) -> tuple[int, int]:
        """Grow or shrink the live pools. New actors are handshaken before they take traffic;
        a removed actor first stops getting new requests, finishes the ones it has, then goes."""
        if self.orchestrator is None:
            raise RuntimeError("start() the deployment first")
        if (num_prefill == 0) != self.orchestrator.colocated or num_decode < 1:
            raise ValueError("resize keeps the serving mode: prefill 0 (colocated) stays 0, and decode >= 1")
        added = self._add(self.prefill, num_prefill - len(self.prefill.members))
        added += self._add(self.decode, num_decode - len(self.decode.members))
        await asyncio.gather(*(m.actor.ready.remote() for m in added))
        await self.orchestrator.refresh(poll_timeout_s=60)
        leaving = self.prefill.members[num_prefill:] + self.decode.members[num_decode:]
        for member in leaving:
            member.draining = True
            member.alive = False
        await asyncio.gather(*(self._drain(m, drain_timeout_s) for m in leaving))
        for pool in (self.prefill, self.decode):
            pool.members = [m for m in pool.members if not m.draining]
        return len(self.prefill.members), len(self.decode.members)

    async def _drain(self, member: Member, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            load = await member.actor.load.remote()
            idle = not (load.running or load.waiting or load.held_for_transfer)
            if member.outstanding_requests == 0 and idle:
                break
            await asyncio.sleep(0.1)
        ray.kill(member.actor, no_restart=True)

    def _add(self, pool: Pool, count: int) -> list[Member]:
        cfg = self.config
        is_prefill = pool is self.prefill
        actor_class, resource = (PrefillActor, PREFILL_RESOURCE) if is_prefill else (DecodeActor, DECODE_RESOURCE)
        # Decode engines of a colocated deployment run without a connector.
        transfer = cfg.transfer if is_prefill or cfg.num_prefill else None
        added = []
        for _ in range(max(0, count)):
            name = f"{pool.role}-{self._named[pool.role]}"
            self._named[pool.role] += 1
            actor = actor_class.options(
                name=name, resources={resource: 1}, num_gpus=cfg.gpus_per_engine, max_restarts=cfg.max_restarts
            ).remote(name, cfg.engine_for(self._started), transfer)
            self._started += 1
            added.append(Member(name, actor))
        pool.members.extend(added)
        return added

    def shutdown(self) -> None:
        for member in self.prefill.members + self.decode.members:
            ray.kill(member.actor, no_restart=True)
        self.prefill.members.clear()
        self.decode.members.clear()
