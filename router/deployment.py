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

    async def start(self) -> Orchestrator:
        cfg = self.config
        for i in range(cfg.num_prefill):
            actor = PrefillActor.options(
                name=f"prefill-{i}",
                resources={PREFILL_RESOURCE: 1},
                num_gpus=cfg.gpus_per_engine,
                max_restarts=cfg.max_restarts,
            ).remote(f"prefill-{i}", cfg.engine_for(i), cfg.transfer)
            self.prefill.members.append(Member(f"prefill-{i}", actor))
        for i in range(cfg.num_decode):
            actor = DecodeActor.options(
                name=f"decode-{i}",
                resources={DECODE_RESOURCE: 1},
                num_gpus=cfg.gpus_per_engine,
                max_restarts=cfg.max_restarts,
            ).remote(f"decode-{i}", cfg.engine_for(cfg.num_prefill + i), cfg.transfer if cfg.num_prefill else None)
            self.decode.members.append(Member(f"decode-{i}", actor))
        members = self.prefill.members + self.decode.members
        await asyncio.gather(*(m.actor.ready.remote() for m in members))
        self.limits = await members[0].actor.model_limits.remote()
        orchestrator = Orchestrator(self.prefill, self.decode, self.limits, cfg.policy)
        await orchestrator.refresh(poll_timeout_s=60)  # handshakes every pair before any traffic
        return orchestrator

    def shutdown(self) -> None:
        for member in self.prefill.members + self.decode.members:
            ray.kill(member.actor, no_restart=True)
        self.prefill.members.clear()
        self.decode.members.clear()
