"""One vLLM engine in the KV-consumer role (or a plain colocated engine without transfer).

`generate(request, handle)` pulls the request's attention blocks and DeltaNet state from the
producer named in the handle (NixlConnector READ), then decodes; every engine step advances
all running requests together. Without a handle the engine prefills the prompt itself,
which is also how the colocated baseline runs (`transfer=None`: no connector at all).

Routers use the batched form: the feed at `feed_address()` streams, a batch per engine step,
the tokens of every request the subscriber starts on it (decode_worker/feed.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Callable

from decode_worker.feed import FeedHub, FeedServer
from kv_transfer.connector_config import (
    Role,
    SideChannel,
    TransferConfig,
    engine_id_for,
)
from kv_transfer.metrics import STATE_BYTES, TransferStatLogger
from messages.errors import InvalidRequestError, TransferFailedError
from messages.requests import GenerateRequest
from messages.results import FeedAddress, TokenChunk
from messages.transfer import TransferHandle
from vllm_engine.config import EngineConfig
from vllm_engine.sampling import sampling_params, token_chunk
from vllm_engine.worker_base import EngineWorker

if TYPE_CHECKING:
    from vllm import SamplingParams


class DecodeWorker(EngineWorker):
    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        transfer: TransferConfig | None,
        channel: SideChannel | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        role: Role = Role.DECODE,
        feed_host: str = "127.0.0.1",
    ) -> None:
        """`feed_host`: the address routers reach this worker's feeds at (its node's)."""
        self.name = name
        self._transfer = transfer
        self._feeds = FeedHub()
        self._feed_server = FeedServer(self._feeds, feed_host, self.start_leg, self.abort_leg)
        if transfer is None:
            self.engine_id = f"colocated-{name}"
            self._start_engine(engine_config, on_fatal=on_fatal)
        else:
            if channel is None:
                raise ValueError("a decode worker with KV transfer needs a NIXL side channel")
            self.engine_id = engine_id_for(role, name, channel)
            self._start_engine(
                engine_config,
                transfer.kv_transfer_config(role, self.engine_id),
                {**channel.process_env(), **transfer.process_env()},
                on_fatal,
                [TransferStatLogger],
            )

    async def release_transfer(self, handle: TransferHandle) -> None:
        """The request behind `handle` will not be decoded (cancelled, expired): have its
        producer free the blocks now. Any decode engine handshaken with that producer can."""
        if self._transfer is None:
            raise ValueError(f"{self.name} is a colocated engine: it has no NIXL connection to {handle.engine_id}")
        await self._engine.release_transfer(handle.connector_params)

    async def generate(
        self, request: GenerateRequest, handle: TransferHandle | None = None
    ) -> AsyncIterator[TokenChunk]:
        """Stream the request's tokens. The first chunk holds the first real token."""
        async for chunk in self._admit(request, handle):
            yield chunk

    async def feed_address(self) -> FeedAddress:
        """Where the feeds are: a subscriber connects, starts its requests there and gets,
        a batch per engine step, the tokens of each."""
        return await self._feed_server.address()

    def start_leg(self, subscriber: str, request: GenerateRequest, handle: TransferHandle | None) -> None:
        """Start decoding into `subscriber`'s feed; a bad request or an expired handle is
        refused (raised) here, later failures arrive in the feed."""
        self._feeds.start(subscriber, request.request_id, self._admit(request, handle))

    def abort_leg(self, request_id: str) -> None:
        self._feeds.abort(request_id)

    def renew_feed(self, subscriber: str) -> None:
        """The subscriber is alive: keep its feed (and requests) going."""
        self._feeds.renew(subscriber)

    def _admit(self, request: GenerateRequest, handle: TransferHandle | None) -> AsyncIterator[TokenChunk]:
        """Check the request now; its tokens stream when the result is iterated."""
        from vllm.sampling_params import RequestOutputKind

        request.validate(self.limits)
        extra_args = None
        if handle is not None:
            if self._transfer is None:
                raise ValueError(f"{self.name} is a colocated engine and cannot load transferred state")
            handle.check_usable(self._transfer.handle_margin_s)
            expected = handle.num_tokens + self._engine.prefill_backoff
            if len(request.prompt_token_ids) != expected:
                raise InvalidRequestError(
                    "prompt",
                    f"has {len(request.prompt_token_ids)} tokens but the handle holds the state of "
                    f"{handle.num_tokens}: decode the prompt it was prefilled from, plus the first "
                    "token if prefill sampled it (PrefillResult.decode_leg)",
                )
            extra_args = {"kv_transfer_params": handle.connector_params}
        params = sampling_params(request.sampling, output_kind=RequestOutputKind.DELTA, extra_args=extra_args)
        return self._stream(request, handle, params)

    async def _stream(
        self, request: GenerateRequest, handle: TransferHandle | None, params: SamplingParams
    ) -> AsyncIterator[TokenChunk]:
        outputs = self._engine.generate(request.request_id, list(request.prompt_token_ids), params)
        if handle is not None:
            outputs = _first_within(outputs, self._transfer.transfer_timeout_s, handle)
        pulled = handle is None
        async for output in outputs:
            if not pulled:  # the first output means the engine holds the pulled state
                pulled = True
                STATE_BYTES.labels("attention_kv").inc(handle.bytes.attention_kv)
                STATE_BYTES.labels("deltanet_state").inc(handle.bytes.deltanet_state)
            completion = output.outputs[0]
            if completion.finish_reason == "error":
                raise TransferFailedError(
                    f"request {request.request_id}: decode could not load its KV blocks / DeltaNet "
                    f"state from {handle.engine_id if handle else 'its producer'} "
                    "(producer gone, blocks expired or handle invalid)"
                )
            yield token_chunk(completion, completion.finish_reason)


async def _first_within(outputs: AsyncIterator, timeout_s: float, handle: TransferHandle) -> AsyncIterator:
    """Pass outputs through, failing if the first (which needs the pulled state) is late.

    On timeout the engine loop's generator is cancelled, which aborts the request there.
    """
    try:
        first = await asyncio.wait_for(anext(outputs), timeout_s)
    except asyncio.TimeoutError:
        raise TransferFailedError(
            f"request {handle.request_id}: no KV blocks / DeltaNet state from {handle.engine_id} "
            f"within {timeout_s:.0f}s (producer stalled or unreachable)"
        ) from None
    yield first
    async for output in outputs:
        yield output

