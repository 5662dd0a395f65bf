"""One deployment behind one router in this process: the stack the demo, the tests, the
benchmarks, the probe and the GPU smoke test start.

`pdserve serve` runs the same pools and request path, with the deployment owned by the
controller actor and the router(s) in actors of their own; here both stay in the caller's
process, so a test or a benchmark reaches the orchestrator and the pools directly.
Ray must be up (cluster.ray_cluster.start_local or join).
"""

from __future__ import annotations

import sys
from typing import Any

from controller.deployment import Deployment, DeploymentConfig
from messages.errors import InvalidRequestError
from router.chat_parsing import ChatParsers
from router.orchestrator import Orchestrator
from router.prompt_encoder import prompt_encoder
from router.server import FrontDoorConfig, RouterServer
from vllm_engine.config import resolve_model


class LocalStack:
    def __init__(
        self,
        config: DeploymentConfig | Deployment,
        *,
        listen: str = "127.0.0.1:0",
        front: FrontDoorConfig | None = None,
        http: str | None = None,
        served_model_name: str | None = None,
        chat: ChatParsers = ChatParsers(),
        text_prompts: bool = True,
        health_interval_s: float = 0.5,
        verbose: bool = False,
    ) -> None:
        """`http`: also serve the OpenAI API there (as `served_model_name`, default the model
        path; `chat`: its tool-call and reasoning parsers). `text_prompts` False: token-id
        prompts only, no tokenizer loaded (benchmarks).
        `verbose`: say on stderr what starts, as the demo does."""
        self.deployment = config if isinstance(config, Deployment) else Deployment(config)
        self._listen, self._front, self._http_address = listen, front or FrontDoorConfig(), http
        self._served_model_name, self._text_prompts = served_model_name, text_prompts
        self._chat = chat
        self._health_interval_s, self._verbose = health_interval_s, verbose
        self.model = resolve_model(self.deployment.config.engine.model)
        self.tokenizer: Any = None
        self.server: RouterServer | None = None
        self.http: Any = None

    @property
    def orchestrator(self) -> Orchestrator:
        assert self.deployment.orchestrator is not None, "start the stack first"
        return self.deployment.orchestrator

    @property
    def address(self) -> str:
        assert self.server is not None, "start the stack first"
        return self.server.address

    async def start(self) -> "LocalStack":
        config = self.deployment.config
        encode = _no_text_prompts
        if self._text_prompts and self._http_address is not None:
            # The OpenAI front needs transformers' tokenizer (chat templates).
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model)
            encode = self.tokenizer.encode
        elif self._text_prompts:  # gRPC alone needs only ids
            encode = prompt_encoder(self.model)
        self._say(f"model {self.model}: starting {config.summary()}...")
        try:
            orchestrator = self.orchestrator if self.deployment.orchestrator else await self.deployment.start()
            for name, capacity in self.deployment.capacities.items():
                self._say(f"  {name}: {capacity.summary()}")
            for link in self.deployment.links:
                self._say(f"  link {link.summary()}")
            self.server = RouterServer(
                orchestrator,
                self.deployment.health,
                encode,
                self.model,
                self._listen,
                health_interval_s=self._health_interval_s,
                scale=self.deployment.resize,
                front=self._front,
            )
            await self.server.start()
            if self._http_address is not None:
                from router.openai_http import HTTPServer, openai_front_for

                name = self._served_model_name or self.model
                front = openai_front_for(self.server, self.tokenizer, name, self._chat)
                self.http = HTTPServer(front, self._http_address)
                await self.http.start()
        except BaseException:
            await self.stop()
            raise
        self._say(f"serving pdserve.v1.Generation on {self.server.address}")
        return self

    async def stop(self, grace_s: float = 0, engines: bool = True) -> None:
        """Stop serving, then every engine of the deployment (`engines` False: the engines
        stay up for other fronts that share the deployment)."""
        try:
            if self.http is not None:
                await self.http.stop()
            if self.server is not None:
                await self.server.stop(grace_s)
        finally:
            if self.deployment.orchestrator is not None:
                await self.deployment.orchestrator.close_feeds()
            if engines:
                self.deployment.shutdown()

    async def __aenter__(self) -> "LocalStack":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _say(self, line: str) -> None:
        if self._verbose:
            print(line, file=sys.stderr)


def _no_text_prompts(text: str) -> list[int]:
    raise InvalidRequestError("text", "this server loaded no tokenizer: send token_ids")
