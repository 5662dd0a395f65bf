"""Bring up the prefill and decode pools as Ray actors, keep them healthy, grow and shrink them.

Whoever holds the Deployment owns the actors: the controller actor in `pdserve serve`
(controller/actor.py), or an in-process router in the demo, tests and benchmarks, which
then routes with `orchestrator` over the same pools.

Under a controller the engines and their placement groups are detached: they outlive a
controller that dies, and the one Ray restarts adopts them from the pools' checkpoint
(controller/checkpoint.py) instead of starting new engines.

Each engine gets its own placement group (one STRICT_PACK bundle: its pool slot plus, on
GPUs, all TP GPUs of the engine on one node). vLLM's ranks are processes the actor spawns
(mp executor), so they run inside that reservation; Ray restarts a crashed actor into the
same reservation, so a restarted TP engine never loses its GPUs to the other pool.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configuration.fields import knob, section
from controller.checkpoint import GcsRecord, PoolRecord, load_pools, save_pools
from kv_transfer.connector_config import TransferConfig
from kv_transfer.link_probe import LinkMeasurement
from kv_transfer.metrics import LINK_GBITS
from messages.membership import ScalingDecision, ScalingOutcome
from messages.reports import EngineCapacity
from messages.requests import ModelLimits
from controller.health import PoolHealth
from router.orchestrator import Orchestrator, RouterPolicy
from cluster.pools import Member, Pool
from cluster.ray_cluster import DECODE_RESOURCE, PREFILL_RESOURCE
from vllm_engine.config import EngineConfig, EngineSizing, resolve_model

log = logging.getLogger(__name__)
LINK_PROBE_TIMEOUT_S = 60.0  # a request-sized READ on the slowest link worth serving on
# An engine asked to stop frees what it holds outside its own processes (a TP engine's vLLM
# shared-memory queues in /dev/shm, up to hundreds of MB each); killed alone it leaves them, since
# Ray kills the resource tracker that would unlink them with it. Killed anyway after this.
ENGINE_STOP_GRACE_S = 20.0


def default_cpu_cores() -> tuple[str, ...] | None:
    """The host's cores, handed to engines in turn on CPU machines (one per TP rank)."""
    return tuple(str(c) for c in sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    # The model and everything both roles must share (NIXL checks a compatibility hash).
    engine: EngineConfig = section(EngineConfig, title="engines (see `pdserve plan` for what a setting holds)")
    transfer: TransferConfig = section(TransferConfig, title="KV transfer (NIXL)")
    num_prefill: int = knob(1, flag="prefill", help="prefill engines (0: colocated serving, no transfer)")
    num_decode: int = knob(1, flag="decode", help="decode engines")
    # What each pool's engines may do differently: TP, batch limit, token budget, KV size.
    prefill_sizing: EngineSizing = section(
        EngineSizing, title="prefill engines (override the shared engine flags)", prefix="prefill-"
    )
    decode_sizing: EngineSizing = section(
        EngineSizing, title="decode engines (override the shared engine flags)", prefix="decode-"
    )
    policy: RouterPolicy = knob(default_factory=RouterPolicy, hidden=True, help="in-process routing policy")
    max_restarts: int = knob(3, help="Ray restarts a crashed engine this many times (a new engine, new NIXL identity)")
    # None: no pinning.
    cpu_cores: tuple[str, ...] | None = knob(
        default_factory=default_cpu_cores,
        shown="the cores this process may use",
        help="CPU machines: cores handed to engine ranks in turn, prefill first",
    )
    # An autoscaler may be adding a node meanwhile.
    placement_timeout_s: float = knob(600.0, help="how long an engine may wait for its placement group")
    # Loading a large model's weights (and compiling) takes minutes on a GPU node.
    start_timeout_s: float = knob(1200.0, help="how long a placed engine may take to load its model and start")
    # 0.5 puts a prefill and a decode engine on one GPU (deploy/gpu_smoke.py), whose
    # gpu_memory_utilization must then add up to less than 1.
    gpus_per_rank: float = knob(
        1.0, help="GPUs each TP rank of a CUDA engine reserves (below 1: engines share GPUs, TP 1)"
    )
    # Routers mirroring the controller's view may learn of a drain a view period late.
    drain_quiet_s: float = knob(2.0, help="a leaving engine stays idle this long before it goes")
    # decode_worker/either_role.py; both pools then run one engine configuration.
    switch_roles: bool = knob(
        False,
        help="every engine runs both NIXL roles: a resize or the planner moves engines between the pools "
        "(drain, relabel) instead of restarting them",
    )

    def __post_init__(self) -> None:
        if self.transfer.kv_buffer_device != self.engine.device:  # KV buffers live where the engines do
            object.__setattr__(self, "transfer", replace(self.transfer, kv_buffer_device=self.engine.device))
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"num_prefill {self.num_prefill}, num_decode {self.num_decode}: "
                "at least one decode engine, prefill 0 or more"
            )
        for name in ("max_restarts", "drain_quiet_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("placement_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.switch_roles and not self.num_prefill:
            raise ValueError("role switching moves engines between prefill and decode: serve with --prefill >= 1")
        if self.switch_roles and self.prefill_sizing != self.decode_sizing:
            raise ValueError(
                "with role switching an engine serves either pool, so both pools run one engine configuration: "
                "set TP, batch limit, token budget and KV size with the shared flags (--max-num-seqs, ...), "
                "not per pool"
            )
        if self.num_prefill:
            check_tp_pairing(
                self.role_engine("prefill").tensor_parallel_size, self.role_engine("decode").tensor_parallel_size
            )
        if not 0 < self.gpus_per_rank <= 1:
            raise ValueError(f"gpus_per_rank must be in (0, 1], got {self.gpus_per_rank}")
        if self.gpus_per_rank < 1 and max(self.role_engine(r).tensor_parallel_size for r in ("prefill", "decode")) > 1:
            raise ValueError(
                "engines share a GPU (gpus_per_rank < 1) only at TP 1, since each TP rank needs a GPU of its own: "
                "pass --prefill-tp 1 --decode-tp 1"
            )

    def summary(self) -> str:
        """The pools as start-up logs name them, e.g. '1 prefill + 2 decode engines (TP 2 / 1)'."""
        tps = (
            f"TP {self.role_engine('prefill').tensor_parallel_size} / {self.role_engine('decode').tensor_parallel_size}"
        )
        return f"{self.num_prefill} prefill + {self.num_decode} decode engines ({tps})"

    def role_engine(self, role: str) -> EngineConfig:
        """The engine configuration of one pool, before cores are handed out."""
        return self.engine.sized(self.prefill_sizing if role == "prefill" else self.decode_sizing)

    def engine_for(self, role: str, first_core: int) -> EngineConfig:
        """One engine of `role`; on CPU its ranks take cores first_core, first_core + 1, ..."""
        config = self.role_engine(role)
        if not self.cpu_cores or config.device != "cpu":
            return config
        n = len(self.cpu_cores)
        ranks = [self.cpu_cores[(first_core + r) % n] for r in range(config.tensor_parallel_size)]
        return config.with_cores("|".join(ranks))


def ask_to_stop(engines: list[Any]) -> None:
    """Ask engine actors to stop; return once all answered, or after ENGINE_STOP_GRACE_S
    (the caller kills them either way)."""
    if engines:
        stopping = [engine.shutdown.remote() for engine in engines]
        ray.wait(stopping, num_returns=len(stopping), timeout=ENGINE_STOP_GRACE_S)


def check_tp_pairing(prefill_tp: int, decode_tp: int) -> None:
    """vLLM 0.32's NixlConnector maps producer and consumer ranks by an integer ratio."""
    small, large = sorted((prefill_tp, decode_tp))
    if large % small:
        raise ValueError(
            f"prefill TP {prefill_tp} cannot hand off to decode TP {decode_tp}: vLLM 0.32's NixlConnector maps "
            "ranks by an integer ratio, so one TP size must be a multiple of the other "
            f"(e.g. {prefill_tp} -> {prefill_tp}, {small} -> {small * 2}, or {large} -> {large // small * small})"
        )


def check_sizing(config: DeploymentConfig) -> None:
    """Refuse, before any actor starts, an engine that cannot split the model's heads over
    its TP ranks or hold one max-length request (on GPUs vLLM's own profile-based check
    at start-up covers memory sized from gpu_memory_utilization)."""
    from vllm_engine.sizing import ModelShape, plan_for

    roles = ("prefill", "decode") if config.num_prefill else ("decode",)
    shape = ModelShape.from_model_dir(resolve_model(config.engine.model))
    for role in roles:
        engine = config.role_engine(role)
        try:
            plan = plan_for(engine, shape)
            if engine.kv_cache_memory_bytes is not None:
                plan.check()
        except ValueError as err:
            raise ValueError(f"{role} engine (TP {engine.tensor_parallel_size}): {err}") from None


class Deployment:
    """Owns the actors it started; `shutdown()` kills them all (no zombie actors)."""

    def __init__(self, config: DeploymentConfig, recovery_key: str | None = None) -> None:
        """`recovery_key`: the engines outlive this object's process (detached actors), and the
        pools are checkpointed under the key for a successor to adopt (`start(adopt=True)`)."""
        self.config = config
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")
        self.health = PoolHealth(self.prefill, self.decode)
        self.limits: ModelLimits | None = None
        self.orchestrator: Orchestrator | None = None
        self.capacities: dict[str, EngineCapacity] = {}
        self.links: list[LinkMeasurement] = []  # measured at start, one per prefill/decode pair
        self._next_core = 0  # CPU cores are handed out in turn
        self._named = {"prefill": 0, "decode": 0, "engine": 0}  # actor names are never reused
        self._placements: dict[str, PlacementGroup] = {}
        self._id = recovery_key or uuid.uuid4().hex[:8]  # Ray-level names stay unique across deployments
        self._record = GcsRecord(f"{recovery_key}/pools") if recovery_key else None

    async def start(self, adopt: bool = False) -> Orchestrator:
        """Start the pools' engines; `adopt`: take over those the checkpoint lists (a restarted
        controller), starting new ones only for a pool left empty."""
        cfg = self.config
        check_sizing(cfg)
        if adopt:
            self._adopt()
        for pool, count in ((self.prefill, cfg.num_prefill), (self.decode, cfg.num_decode)):
            if not pool.members:  # a fresh start, or a pool none of whose engines survived
                self._add(pool, count)
        members = self.prefill.members + self.decode.members
        await self._ready(members)
        self.limits = await members[0].actor.model_limits.remote()
        await self.health.refresh(poll_timeout_s=60)  # handshakes every pair before any traffic
        # Adopted engines are serving: their links were measured when they started.
        self.links = [] if adopt else await self._measure_links()
        self.orchestrator = Orchestrator(self.prefill, self.decode, self.limits, cfg.policy)
        self._checkpoint()
        return self.orchestrator

    def _actor_name(self, name: str) -> str:
        return f"pdserve-{self._id}-{name}"  # Ray names are cluster-wide: deployments may coexist

    def _placement_name(self, name: str) -> str:
        return f"pdserve-{name}-{self._id}"

    def _checkpoint(self) -> None:
        if self._record is not None:
            pools = PoolRecord(
                tuple(m.name for m in self.prefill.members),
                tuple(m.name for m in self.decode.members),
                tuple(self._named.items()),
                self._next_core,
            )
            save_pools(self._record, pools)

    def _adopt(self) -> None:
        """Take the checkpoint's engines that still run into the pools (JOINING: the first
        refresh handshakes them again). Engines of ours it does not list were being added
        when the predecessor died, and go."""
        assert self._record is not None, "only a deployment with a recovery key adopts"
        pools = load_pools(self._record) or PoolRecord((), (), (), 0)
        prefix = self._actor_name("")
        running = {n[len(prefix) :] for n in ray.util.list_named_actors() if n.startswith(prefix)}
        for name in sorted(running - set(pools.prefill + pools.decode)):
            log.warning("%s: started but not yet recorded by the last controller: stopping it", name)
            self._remove(self._adopted(name))
        self._named.update(dict(pools.next_index))
        self._next_core = pools.next_core
        for pool, names in ((self.prefill, pools.prefill), (self.decode, pools.decode)):
            for name in names:
                if name in running:
                    pool.members.append(self._adopted(name))
                else:
                    log.warning("%s: gone while no controller watched it", name)
        log.info("adopted %s", ", ".join(m.name for m in self.prefill.members + self.decode.members) or "no engine")

    def _adopted(self, name: str) -> Member:
        try:
            self._placements[name] = ray.util.get_placement_group(self._placement_name(name))
        except ValueError:
            pass  # its reservation went with it; _ready then waits on the actor alone
        return Member(name, ray.get_actor(self._actor_name(name)))

    async def _measure_links(self) -> list[LinkMeasurement]:
        """One READ of `link_probe_bytes` from every prefill engine by every decode engine, a
        pair at a time (pairs would share the links). A failed probe is logged, not fatal:
        the requests' own transfers then say more."""
        nbytes = self.config.transfer.link_probe_bytes
        if not nbytes or not self.config.num_prefill:
            return []
        measured = []
        for source in self.prefill.members:
            for reader in self.decode.members:
                offer = await source.actor.probe_offer.remote(nbytes)
                serving = source.actor.probe_serve.remote(LINK_PROBE_TIMEOUT_S)
                try:
                    seconds = await reader.actor.probe_read.remote(offer, LINK_PROBE_TIMEOUT_S)
                except Exception as err:
                    log.warning("link probe %s -> %s failed: %s", source.name, reader.name, err)
                    continue
                finally:
                    await serving
                link = LinkMeasurement(source.name, reader.name, nbytes, seconds)
                LINK_GBITS.labels(source.name, reader.name).set(link.gbit_s)
                log.info("link %s", link.summary())
                measured.append(link)
        return measured

    async def resize(self, decision: ScalingDecision, drain_timeout_s: float = 300.0) -> ScalingOutcome:
        """Grow or shrink the live pools. New actors are handshaken before they take traffic;
        a removed actor first stops getting new requests, finishes the ones it has, then goes.
        The decision's `tensor_parallel` (the TP sizes a plan assumes) is checked against ours."""
        if self.orchestrator is None:
            raise RuntimeError("start() the deployment first")
        num_prefill, num_decode, tensor_parallel = decision.prefill, decision.decode, decision.tensor_parallel
        if (num_prefill == 0) != self.orchestrator.colocated or num_decode < 1:
            raise ValueError("resize keeps the serving mode: prefill 0 (colocated) stays 0, and decode >= 1")
        ours = tuple(self.config.role_engine(role).tensor_parallel_size for role in ("prefill", "decode"))
        if tensor_parallel is not None and tensor_parallel != ours:
            raise ValueError(
                f"the plan is for TP {tensor_parallel[0]} prefill / {tensor_parallel[1]} decode engines, "
                f"this deployment runs TP {ours[0]} / {ours[1]}: restart `pdserve serve` "
                f"with --prefill-tp {tensor_parallel[0]} "
                f"--decode-tp {tensor_parallel[1]}, or tune with the live engines' sizes"
            )
        before = len(self.prefill.members), len(self.decode.members)
        log.info("resize %dP:%dD to %dP:%dD (%s)", *before, num_prefill, num_decode, decision.reason)
        if self.config.switch_roles:
            await self._switch_roles(num_prefill, num_decode, drain_timeout_s)
        added = self._add(self.prefill, num_prefill - len(self.prefill.members))
        added += self._add(self.decode, num_decode - len(self.decode.members))
        await self._ready(added)
        await self.health.refresh(poll_timeout_s=60)
        leaving = self.prefill.members[num_prefill:] + self.decode.members[num_decode:]
        for member in leaving:
            member.mark_draining()
        await asyncio.gather(*(self._drain(m, drain_timeout_s) for m in leaving))
        for pool in (self.prefill, self.decode):
            pool.members = pool.staying
        self._checkpoint()
        outcome = ScalingOutcome(decision, before, (len(self.prefill.members), len(self.decode.members)))
        log.info("%s", outcome)
        return outcome

    async def _ready(self, members: list[Member]) -> None:
        """Wait for each engine's reservation and start-up; record what each can hold."""
        timeout = self.config.placement_timeout_s
        for member in members:
            placement = self._placements.get(member.name)
            if placement is None:
                continue
            try:
                await asyncio.wait_for(placement.ready(), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(
                    f"{member.name}: no node offered {placement.bundle_specs[0]} on one node within {timeout:.0f}s: "
                    "add nodes of that pool's type (or let the autoscaler), or lower the TP size"
                ) from None
        if not members:  # a resize that only shrinks
            return
        starting = {m.name: asyncio.ensure_future(m.actor.ready.remote()) for m in members}
        _, late = await asyncio.wait(starting.values(), timeout=self.config.start_timeout_s)
        if late:
            for future in late:
                future.cancel()
            names = ", ".join(name for name, future in starting.items() if future in late)
            raise RuntimeError(
                f"{names}: not started within {self.config.start_timeout_s:g}s of being placed: the engine's "
                "Ray worker log (worker-*.err on its node) says where it stopped"
            )
        for future in starting.values():
            future.result()  # an engine that failed to start raises here
        capacities = await asyncio.gather(*(m.actor.capacity.remote() for m in members))
        for member, capacity in zip(members, capacities):
            self.capacities[member.name] = member.capacity = capacity
            log.info("%s: %s", member.name, capacity.summary())

    async def _switch_roles(self, num_prefill: int, num_decode: int, drain_timeout_s: float) -> None:
        """Move engines from the pool that shrinks to the pool that grows, least loaded
        first: each stops getting requests of its old role, finishes them, changes pool and
        handshakes with its new peers before it takes traffic. No engine restarts."""
        for source, target, source_size in (
            (self.decode, self.prefill, num_decode),
            (self.prefill, self.decode, num_prefill),
        ):
            target_size = num_prefill + num_decode - source_size
            count = min(len(source.members) - source_size, target_size - len(target.members))
            if count <= 0:
                continue
            movers = sorted(source.members, key=lambda m: (not m.live, m.estimated_requests))[:count]
            for member in movers:
                member.mark_draining()
            await asyncio.gather(*(self._wait_idle(m, drain_timeout_s) for m in movers))
            for member in movers:
                source.members.remove(member)
                member.mark_joining()  # the next refresh handshakes it with its new peers
                member.feed = None  # a router's decode feed on it; set again when it decodes
                target.members.append(member)
            log.info("moved %s from %s to %s", ", ".join(m.name for m in movers), source.role, target.role)

    async def _drain(self, member: Member, timeout_s: float) -> None:
        await self._wait_idle(member, timeout_s)
        await asyncio.wait([asyncio.ensure_future(member.actor.shutdown.remote())], timeout=ENGINE_STOP_GRACE_S)
        self._remove(member)

    async def _wait_idle(self, member: Member, timeout_s: float) -> None:
        """Until the engine has had nothing to do for drain_quiet_s (or the timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        quiet_since: float | None = None
        while loop.time() < deadline:
            load = await member.actor.load.remote()
            idle = not (load.running or load.waiting or load.held_for_transfer)
            if member.outstanding_requests == 0 and idle:
                quiet_since = quiet_since or loop.time()
                if loop.time() - quiet_since >= self.config.drain_quiet_s:
                    break
            else:
                quiet_since = None
            await asyncio.sleep(0.1)

    def _add(self, pool: Pool, count: int) -> list[Member]:
        # Here, not at the top: the actor modules load vLLM, which a config reader need not.
        from decode_worker.actor import DecodeActor
        from decode_worker.either_role import EitherRoleActor
        from prefill_worker.actor import PrefillActor

        cfg = self.config
        is_prefill = pool is self.prefill
        actor_class, resource = (PrefillActor, PREFILL_RESOURCE) if is_prefill else (DecodeActor, DECODE_RESOURCE)
        # Decode engines of a colocated deployment run without a connector.
        transfer = cfg.transfer if is_prefill or cfg.num_prefill else None
        # An engine that may change pool is named for neither; it keeps the node slot
        # (resource) of the pool it started in.
        kind = "engine" if cfg.switch_roles else pool.role
        if cfg.switch_roles:
            actor_class = EitherRoleActor
        added = []
        for _ in range(max(0, count)):
            name = f"{kind}-{self._named[kind]}"
            self._named[kind] += 1
            engine = cfg.engine_for(pool.role, self._next_core)
            self._next_core += engine.tensor_parallel_size
            gpus = engine.tensor_parallel_size * cfg.gpus_per_rank if engine.device == "cuda" else 0
            bundle = {resource: 1.0, **({"GPU": float(gpus)} if gpus else {})}
            detached = "detached" if self._record is not None else None
            placement = placement_group(
                [bundle], strategy="STRICT_PACK", name=self._placement_name(name), lifetime=detached
            )
            self._placements[name] = placement
            actor = actor_class.options(
                name=self._actor_name(name),
                lifetime=detached,
                resources={resource: 1},
                num_gpus=gpus,
                max_restarts=cfg.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=0),
            ).remote(name, engine, transfer)
            added.append(Member(name, actor))
        pool.members.extend(added)
        return added

    def _remove(self, member: Member) -> None:
        ray.kill(member.actor, no_restart=True)
        placement = self._placements.pop(member.name, None)
        if placement is not None:
            remove_placement_group(placement)

    def shutdown(self) -> None:
        """Ask every engine to stop, then kill it (answered or not, within ENGINE_STOP_GRACE_S)."""
        if self.orchestrator is not None:
            self.orchestrator.close()
        members = self.prefill.members + self.decode.members
        ask_to_stop([member.actor for member in members])
        for member in members:
            self._remove(member)
        self.prefill.members.clear()
        self.decode.members.clear()
        if self._record is not None:
            self._record.remove()
