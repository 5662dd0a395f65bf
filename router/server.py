"""The router's async gRPC server: Generate streaming, model info, health and reflection."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from ray.exceptions import RayActorError

from decode_worker.worker import TransferFailedError
from kv_transfer.handle import HandleExpiredError
from prefill_worker.worker import PrefillFailedError
from proto.pdserve.v1 import generate_pb2 as pb
from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc
from router.convert import decode_request, encode_chunk, encode_final
from router.metrics import REQUESTS
from router.orchestrator import DecodeFailedError, GenerationResult, Orchestrator
from router.pools import NoWorkerError
from vllm_engine.requests import InvalidRequestError

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_UNAVAILABLE = (
    NoWorkerError,
    TransferFailedError,
    HandleExpiredError,
    PrefillFailedError,
    DecodeFailedError,
    RayActorError,
)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator, tokenize: Callable[[str], list[int]], model: str) -> None:
        self._orchestrator = orchestrator
        self._tokenize = tokenize
        self._model = model

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            generate_request = decode_request(request, self._tokenize)
            async for event in self._orchestrator.generate(generate_request):
                if isinstance(event, GenerationResult):
                    yield encode_final(generate_request.request_id, event)
                else:
                    yield encode_chunk(event)
        except InvalidRequestError as err:
            REQUESTS.labels("invalid_argument").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except _UNAVAILABLE as err:
            REQUESTS.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, _first_line(err))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        limits = self._orchestrator.limits
        return pb.ModelInfo(
            model=self._model,
            max_model_len=limits.max_model_len,
            vocab_size=limits.vocab_size,
            prefill_actors=sum(m.alive for m in self._orchestrator.prefill.members),
            decode_actors=sum(m.alive for m in self._orchestrator.decode.members),
        )


# (prefill, decode, TP sizes the caller's plan assumes or None) -> new pool sizes.
Scaler = Callable[[int, int, "tuple[int, int] | None"], Awaitable[tuple[int, int]]]


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, scale: Scaler | None) -> None:
        self._scale = scale

    async def ScalePools(self, request: pb.ScalePoolsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if self._scale is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this router does not own its pools")
        try:
            tensor_parallel = (request.prefill_tp, request.decode_tp) if request.prefill_tp or request.decode_tp else None
            prefill, decode = await self._scale(request.prefill, request.decode, tensor_parallel)
        except ValueError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return pb.PoolSizes(prefill=prefill, decode=decode)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[-1] if text else type(err).__name__


class RouterServer:
    """gRPC server plus the background task that polls pool loads and sets health."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenize: Callable[[str], list[int]],
        model: str,
        address: str = "127.0.0.1:0",
        health_interval_s: float = 0.5,
        scale: Scaler | None = None,
    ) -> None:
        self._orchestrator = orchestrator
        self._server = grpc.aio.server()
        self._health = HealthServicer()
        self._health_interval_s = health_interval_s
        self._monitor: asyncio.Task[Any] | None = None
        pb_grpc.add_GenerationServicer_to_server(GenerationService(orchestrator, tokenize, model), self._server)
        pb_grpc.add_AdminServicer_to_server(AdminService(scale), self._server)
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
        self.port = self._server.add_insecure_port(address)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"

    async def start(self) -> None:
        await self._update_health()
        await self._server.start()
        self._monitor = asyncio.create_task(self._monitor_pools())

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._monitor:
            self._monitor.cancel()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)

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
        o = self._orchestrator
        await o.refresh(poll_timeout_s=max(1.0, 4 * self._health_interval_s))
        serving = o.decode.has_live_member and (o.colocated or o.prefill.has_live_member)
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)
