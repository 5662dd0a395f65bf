"""One vLLM engine in the KV-consumer role (or a plain colocated engine without transfer).

`generate(request, handle)` pulls the request's attention blocks and DeltaNet state from the
producer named in the handle (NixlConnector READ), then decodes; every engine step advances
all running requests together. Without a handle the engine prefills the prompt itself,
which is also how the colocated baseline runs (`transfer=None`: no connector at all).

Routers use the batched form: the feed at `feed_address()` streams, a batch per engine step,
the tokens of every request the subscriber starts on it (vllm_engine/feed.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, AsyncIterator

from kv_transfer.connector_config import Role
from kv_transfer.consumer import check_loaded
from messages.reports import EngineLoad
from messages.requests import GenerateRequest
from messages.results import StartLeg, TokenChunk
from messages.transfer import TransferHandle
from vllm_engine.feed import FeedCommands
from vllm_engine.sampling import engine_prompt, sampling_params, token_chunk
from vllm_engine.worker_base import EngineWorker

if TYPE_CHECKING:
    from vllm import SamplingParams


class DecodeWorker(EngineWorker):
    connector_role = Role.DECODE

    def load(self) -> EngineLoad:
        """The engine's load, with its requests counted by the feed that started each."""
        return replace(super().load(), requests_by_feed=self._feeds.requests_by_feed())

    async def release_transfer(self, handle: TransferHandle) -> None:
        """The request behind `handle` will not be decoded (cancelled, expired): have its
        producer free the blocks now. Any decode engine handshaken with that producer can."""
        if self._consumer is None:
            raise ValueError(f"{self.name} is a colocated engine: it has no NIXL connection to {handle.engine_id}")
        await self._engine.release_transfer(handle.connector_params)

    async def generate(
        self, request: GenerateRequest, handle: TransferHandle | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens. The first chunk holds the first real token."""
        async for chunk in self._admit(request, handle):
            yield chunk

    def start_leg(self, subscriber: str, request: GenerateRequest, handle: TransferHandle | None) -> None:
        """Start decoding into `subscriber`'s feed; a bad request or an expired handle is
        refused (raised) here, later failures arrive in the feed."""
        self._feeds.start(subscriber, request.request_id, self._admit(request, handle))

    def _feed_commands(self) -> FeedCommands:
        start = {StartLeg: lambda subscriber, command: self.start_leg(subscriber, command.request, command.handle)}
        return {**super()._feed_commands(), **start}

    def _admit(self, request: GenerateRequest, handle: TransferHandle | None) -> AsyncIterator[TokenChunk]:
        """Check the request now; its tokens stream when the result is iterated."""
        from vllm.sampling_params import RequestOutputKind

        request.validate(self.limits)
        extra_args = None
        if handle is not None:
            if self._consumer is None:
                raise ValueError(f"{self.name} is a colocated engine and cannot load transferred state")
            extra_args = self._consumer.pull_args(request, handle)
        params = sampling_params(request.sampling, output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
        return self._stream(request, handle, params)

    async def _stream(
        self, request: GenerateRequest, handle: TransferHandle | None, params: SamplingParams
    ) -> AsyncIterator[TokenChunk]:
        outputs = self._engine.generate(request.request_id, engine_prompt(request), params)
        if handle is not None:
            outputs = self._consumer.pulled(handle, outputs)
        async for output in outputs:
            finish_reason = output.outputs[0].finish_reason
            check_loaded(request.request_id, finish_reason, handle)
            yield token_chunk(output, finish_reason)
