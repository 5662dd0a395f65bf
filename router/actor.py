"""A router as a Ray actor: a stateless request path in front of the controller's pools.

`pdserve serve --routers N` starts N of them; on one host they share the listening port
(SO_REUSEPORT: the kernel spreads connections over them), on several nodes each listens
on its own. A router that dies takes only its own streams: the controller owns the
engines, each decode actor aborts the requests of a feed whose router is gone, and a
prefill's blocks go back at the end of their lease. A new router can join at any time.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

from configuration.fields import knob, section
from messages.membership import ScalingDecision, ScalingOutcome
from router.chat_parsing import ChatParsers
from router.orchestrator import Orchestrator, RouterPolicy
from router.prompt_encoder import prompt_encoder
from router.server import FrontDoorConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterSettings:
    # As the engines' config gives it: "embedded" is built on the router's own node.
    model: str = knob("", hidden=True, help="the model the routers tokenize for (set from the engines' config)")
    listen: str = knob("127.0.0.1:50051", help="gRPC address (routers on one host share the port)")
    front: FrontDoorConfig = section(FrontDoorConfig, title="front door")
    policy: RouterPolicy = section(RouterPolicy, title="routing policy")
    http: str | None = knob(None, help="also serve the OpenAI-compatible HTTP API on this HOST:PORT")
    served_model_name: str | None = knob(None, help="model id for the HTTP API (unset: --model)")
    chat: ChatParsers = section(ChatParsers, title="HTTP chat: tool calls and reasoning (vLLM's parsers)")
    metrics_port: int = knob(9400, help="router i serves Prometheus metrics on this port + i (0: off)")
    metrics_host: str = knob("127.0.0.1", help="address the metrics endpoints bind")
    health_interval_s: float = knob(0.5, help="seconds between two looks at the controller's view of the pools")
    # Set by the tier (`serve --routers`): the admission shares leave room for routers yet to report.
    tier_size: int = knob(1, hidden=True, help="routers the tier starts with")

    def __post_init__(self) -> None:
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s must be > 0, got {self.health_interval_s}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port {self.metrics_port}: a TCP port, or 0 for no metrics endpoint")


@dataclass(frozen=True, slots=True)
class RouterAddresses:
    grpc: str
    http: str | None
    metrics: str | None


@ray.remote(num_cpus=0, max_concurrency=16)
class RouterActor:
    def __init__(self, name: str, controller: Any, settings: RouterSettings) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        self._name = name
        self._controller = controller
        self._settings = settings
        self._server: Any = None
        self._http: Any = None

    async def serve(self) -> RouterAddresses:
        from router.metrics import serve_metrics
        from router.mirror import ControllerMirror
        from router.server import RouterServer
        from vllm_engine.config import resolve_model

        s = self._settings
        model = resolve_model(s.model)
        tokenizer = None
        if s.http:  # the OpenAI front needs transformers' tokenizer (chat templates)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
            encode = tokenizer.encode
        else:  # gRPC alone needs only ids
            encode = prompt_encoder(model)
        controller = self._controller
        view = await controller.view.remote()
        mirror = ControllerMirror(controller, view, self._name, s.tier_size)
        orchestrator = Orchestrator(mirror.prefill, mirror.decode, view.limits, s.policy, mirror.journal)

        async def scale(decision: ScalingDecision) -> ScalingOutcome:
            try:
                return await controller.resize.remote(decision)
            except ray.exceptions.RayTaskError as err:  # the controller's refusal, without Ray's traceback
                raise err.cause from None

        self._server = RouterServer(
            orchestrator, mirror, encode, model, s.listen, s.health_interval_s, scale, s.front, tier=mirror
        )
        await self._server.start()
        http = metrics = None
        if s.http:
            from router.openai_http import HTTPServer, openai_front_for

            front = openai_front_for(self._server, tokenizer, s.served_model_name or s.model, s.chat)
            self._http = HTTPServer(front, s.http, s.front.tls, reuse_port=True)
            await self._http.start()
            http = self._http.address
        if s.metrics_port:
            metrics = serve_metrics(s.metrics_host, s.metrics_port)
        await controller.register_router.remote(self._name, metrics)
        # What the router has loaded by now (vLLM's request models, the tokenizer) lives as long
        # as it does: frozen, a full collection no longer walks it (hundreds of ms at this size,
        # with every stream on this router paused); vLLM's engine core freezes its own too.
        gc.collect()
        gc.freeze()
        return RouterAddresses(self._server.address, http, metrics)

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting, let live streams finish for up to `timeout_s`, stop."""
        finished = await self._server.drain(timeout_s)
        if self._http is not None:
            await self._http.stop()
        await self._controller.router_left.remote(self._name)
        return finished

    def pid(self) -> int:
        return os.getpid()
