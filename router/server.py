"""The router's async gRPC server: Generate streaming, model info, admin, health, reflection,
and the front door around them (TLS, tokens, admission, input limits, graceful drain)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from configuration.fields import knob, section
from configuration.parsers import parse_bytes
from messages.errors import OverloadedError, client_status
from messages.membership import ScalingDecision, ScalingOutcome
from messages.results import GenerationResult
from proto.pdserve.v1 import generate_pb2 as pb
from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc
from messages.membership import AdmissionLimits
from router.admission import AdmissionController
from router.binding import bind_error
from router.convert import decode_request, encode_chunk, encode_final
from router.metrics import REQUESTS
from router.orchestrator import Orchestrator
from cluster.prometheus_targets import write_targets
from router.security import AuthInterceptor, ServerTLS, TokenTable

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Per-pool health (the overall status stays SERVING while decode engines can prefill locally).
PREFILL_HEALTH, DECODE_HEALTH = f"{SERVICE_NAME}/prefill", f"{SERVICE_NAME}/decode"
# gRPC's standard trailer for how long a client should wait before retrying.
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


@dataclass(frozen=True, slots=True)
class FrontDoorConfig:
    tls: ServerTLS | None = section(None, title="front door: TLS", prefix="tls-")
    tokens: TokenTable | None = knob(
        None,
        flag="tokens-file",
        parse=TokenTable.load,
        absent=lambda: TokenTable.load(None),
        help="file of ROLE:TOKEN lines (roles generate, admin); unset: $PDSERVE_TOKENS, else no authentication",
    )
    # Admission: unset derives from the decode pool (sum of its engines' max_num_seqs).
    max_in_flight: int | None = knob(None, help="requests admitted at once (unset: the decode pool's batch capacity)")
    max_queue: int | None = knob(None, help="requests waiting for a slot (unset: as many as in flight)")
    max_prompt_bytes_per_token: int = knob(32, help="text prompts: bytes allowed per max_model_len token")
    max_concurrent_streams: int = knob(4096, help="gRPC streams per HTTP/2 connection")
    max_message_bytes: int = knob(4 << 20, parse=parse_bytes, help="largest gRPC message in or out")
    max_pool_size: int = knob(64, flag="max-engines-per-pool", help="Admin.ScalePools refuses more engines per pool")
    prometheus_sd_file: str | None = knob(
        None, help="keep a Prometheus file_sd target file of the engines' and routers' metrics endpoints here"
    )

    def __post_init__(self) -> None:
        for name in ("max_prompt_bytes_per_token", "max_concurrent_streams", "max_message_bytes", "max_pool_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_in_flight", "max_queue"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "max_in_flight" else 0):
                raise ValueError(f"{name} {value}: admit at least 1 request, queue 0 or more")


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenize: Callable[[str], list[int]],
        model: str,
        admission: AdmissionController,
        max_prompt_bytes: int,
    ) -> None:
        self._orchestrator = orchestrator
        self._tokenize = tokenize
        self._model = model
        self._admission = admission
        self._max_prompt_bytes = max_prompt_bytes

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        refusal: tuple[grpc.StatusCode, str, str] | None = None
        try:
            generate_request = await decode_request(request, self._tokenize, self._max_prompt_bytes)
            generate_request.validate(self._orchestrator.limits)  # before it takes a slot
            async with self._admission.admitted():
                async for event in self._orchestrator.generate(generate_request):
                    if isinstance(event, GenerationResult):
                        yield encode_final(generate_request.request_id, event)
                    else:
                        yield encode_chunk(event)
        except Exception as err:
            status = client_status(err)
            if status is None:
                log.exception("request %s failed", request.request_id or "(no client id)")
                message = (
                    f"internal error serving request {request.request_id or '(no id)'}; the router's log has details"
                )
                status = (grpc.StatusCode.INTERNAL, message)
            elif status[0] == grpc.StatusCode.UNAVAILABLE:
                log.warning("request %s: %s", request.request_id, err)
            elif isinstance(err, OverloadedError):
                context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(int(err.retry_after_s * 1000))),))
            refusal = (*status, status[0].name.lower())
        if refusal is not None:
            code, message, outcome = refusal
            REQUESTS.labels(outcome).inc()
            await context.abort(code, message)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        limits = self._orchestrator.limits
        return pb.ModelInfo(
            model=self._model,
            max_model_len=limits.max_model_len,
            vocab_size=limits.vocab_size,
            prefill_actors=len(self._orchestrator.prefill.live),
            decode_actors=len(self._orchestrator.decode.live),
        )


class Membership(Protocol):
    """What keeps the router's pools current: the pools' own health polling when this
    router owns them (controller/health.py), or a mirror of the controller's view."""

    async def refresh(self, poll_timeout_s: float) -> None: ...


class TierAdmission(Protocol):
    """One router among several (router/mirror.py): its admission counts go out with each
    view request, and its share of the tier's limits comes back."""

    grant: AdmissionLimits | None

    def share(self, in_flight: int, waiting: int, limits: AdmissionLimits) -> None: ...


# Whoever owns the pools: the controller, or this router's own deployment.
Scaler = Callable[[ScalingDecision], Awaitable[ScalingOutcome]]


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, scale: Scaler | None, max_pool_size: int) -> None:
        self._scale = scale
        self._max_pool_size = max_pool_size
        self._resizing = asyncio.Lock()  # one resize at a time

    async def ScalePools(self, request: pb.ScalePoolsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if self._scale is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router does not own its pools")
        if max(request.prefill, request.decode) > self._max_pool_size:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"pool sizes {request.prefill}/{request.decode}: at most {self._max_pool_size} engines per pool",
            )
        if self._resizing.locked():
            await context.abort(grpc.StatusCode.ABORTED, "a resize is already in progress: retry when it is done")
        async with self._resizing:
            try:
                tp = (request.prefill_tp, request.decode_tp) if request.prefill_tp or request.decode_tp else None
                outcome = await self._scale(ScalingDecision(request.prefill, request.decode, "Admin.ScalePools", tp))
            except (ValueError, RuntimeError) as err:
                refusal = str(err)
            else:
                prefill, decode = outcome.after
                return pb.PoolSizes(prefill=prefill, decode=decode)
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)


def admission_limits(orchestrator: Orchestrator, front: FrontDoorConfig) -> AdmissionLimits:
    """The whole router tier's: configured, or the decode pool's batch capacity (what its
    live engines run at once)."""
    live = [m for m in orchestrator.decode.live if m.capacity]
    in_flight = front.max_in_flight or max(1, sum(m.capacity.max_num_seqs for m in live))  # type: ignore[union-attr]
    return AdmissionLimits(in_flight, in_flight if front.max_queue is None else front.max_queue)


def router_limits(tier_limits: AdmissionLimits, grant: AdmissionLimits | None) -> AdmissionLimits:
    """What this router admits: the tier's limits, or its grant of them when it shares them."""
    if grant is None:
        return tier_limits
    return AdmissionLimits(
        min(tier_limits.max_in_flight, grant.max_in_flight), min(tier_limits.max_queue, grant.max_queue)
    )


def bind_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Bind the gRPC front to `address` (port 0: any free one); the port it got. gRPC's own
    error names no cause, so a failed bind is tried with a plain socket to say why."""
    try:
        return server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:
        host, port = address.rsplit(":", 1)
        try:
            socket.create_server((host.strip("[]"), int(port))).close()
        except OSError as err:
            raise bind_error("gRPC front", host, port, err) from None
        raise OSError(f"gRPC front {address}: gRPC could not bind it (GRPC_VERBOSITY=debug says why)") from None


class RouterServer:
    """gRPC server plus the background task that polls pool loads and sets health."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        membership: Membership,
        tokenize: Callable[[str], list[int]],
        model: str,
        address: str = "127.0.0.1:0",
        health_interval_s: float = 0.5,
        scale: Scaler | None = None,
        front: FrontDoorConfig = FrontDoorConfig(),
        tier: TierAdmission | None = None,
    ) -> None:
        """`tier`: this router shares its limits with other routers."""
        self.orchestrator = orchestrator
        self.membership = membership
        self.front = front
        self._tier = tier
        self.admission = AdmissionController(
            lambda: router_limits(admission_limits(orchestrator, front), tier.grant if tier else None)
        )
        self._server = grpc.aio.server(
            interceptors=[AuthInterceptor(front.tokens)] if front.tokens else None,
            options=[
                ("grpc.max_concurrent_streams", front.max_concurrent_streams),
                ("grpc.max_receive_message_length", front.max_message_bytes),
                ("grpc.max_send_message_length", front.max_message_bytes),
            ],
        )
        self._health = HealthServicer()
        self._health_interval_s = health_interval_s
        self._monitor: asyncio.Task[Any] | None = None
        self.max_prompt_bytes = front.max_prompt_bytes_per_token * orchestrator.limits.max_model_len
        generation = GenerationService(orchestrator, tokenize, model, self.admission, self.max_prompt_bytes)
        pb_grpc.add_GenerationServicer_to_server(generation, self._server)
        pb_grpc.add_AdminServicer_to_server(AdminService(scale, front.max_pool_size), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                pb.DESCRIPTOR.services_by_name["Admin"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._server,
        )
        self.port = bind_port(self._server, address, front.tls)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> None:
        await self._update_health()
        await self._server.start()
        self._monitor = asyncio.create_task(self._monitor_pools())

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting (health NOT_SERVING, new requests UNAVAILABLE), let live streams
        finish for up to `timeout_s`, then stop. True if every stream finished in time."""
        self.admission.start_draining()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        finished = await self.admission.wait_idle(timeout_s)
        await self.stop(0)
        return finished

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._monitor:
            self._monitor.cancel()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        self.orchestrator.close()

    async def wait(self) -> None:
        await self._server.wait_for_termination()

    async def _monitor_pools(self) -> None:
        while True:
            await asyncio.sleep(self._health_interval_s)
            try:
                await self._update_health()
            except Exception:  # keep monitoring; a failed poll marks members dead
                log.exception("pool health poll failed")

    async def _update_health(self) -> None:
        o = self.orchestrator
        if self._tier is not None:
            self._tier.share(self.admission.in_flight, self.admission.waiting, admission_limits(o, self.front))
        await self.membership.refresh(poll_timeout_s=max(1.0, 4 * self._health_interval_s))
        self.admission.limits_changed()
        if self.front.prometheus_sd_file:
            write_targets(Path(self.front.prometheus_sd_file), (o.prefill, o.decode))
        if self.admission.draining:
            return
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        # Prefill can fall back to the decode engines, so only the decode pool decides.
        await self._set_health(serving if o.decode.has_live_member else not_serving)
        await self._health.set(DECODE_HEALTH, serving if o.decode.has_live_member else not_serving)
        if not o.colocated:  # degraded, not down, while prefill has no live actor
            await self._health.set(PREFILL_HEALTH, serving if o.prefill.has_live_member else not_serving)

    async def _set_health(self, status: int) -> None:
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)
