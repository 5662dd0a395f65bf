"""One vLLM engine in the KV-producer role.

For each request it runs prefill and returns a `TransferHandle`; the engine keeps the
request's attention blocks and DeltaNet state slots until decode has read them or the lease
runs out. What the leg asks of the engine and who samples the first token is the producer
half's (kv_transfer.producer). Routers start prefills on their feed here (`start_prefill`,
vllm_engine/feed.py) and hear the result there.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from kv_transfer.connector_config import Role
from kv_transfer.producer import TransferProducer
from messages.requests import GenerateRequest
from messages.results import PrefillResult, StartPrefill
from vllm_engine.feed import FeedCommands
from vllm_engine.sampling import engine_prompt, sampling_params, token_chunk
from vllm_engine.worker_base import EngineWorker


class PrefillWorker(EngineWorker):
    connector_role = Role.PREFILL
    _producer: TransferProducer

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        request.validate(self._engine.limits)
        started = time.perf_counter()
        leg = self._producer.leg(request)
        params = sampling_params(request.sampling, **leg.overrides)
        final = None
        async for output in self._engine.generate(request.request_id, engine_prompt(request), params):
            final = output
        connector_params = self._producer.held_params(request.request_id, final)
        if self._producer.wants_digests():  # while the engine holds the blocks for decode
            digests = await self._engine.on_every_rank("pdserve_transfer_digests", connector_params["remote_block_ids"])
            connector_params = self._producer.with_digests(connector_params, digests)
        handle = self._producer.grant(connector_params, await self._engine.state_layout())
        first = None
        if leg.samples_first:
            reason = self._producer.first_finish_reason(request, final.outputs[0].finish_reason)
            first = token_chunk(final, reason)
        return PrefillResult(handle, time.perf_counter() - started, first, final.num_cached_tokens or 0)

    def start_prefill(self, subscriber: str, request: GenerateRequest) -> None:
        """Prefill `request` in `subscriber`'s feed: its result, or why not, comes back there."""
        self._feeds.start(subscriber, request.request_id, self._prefilled(request))

    async def _prefilled(self, request: GenerateRequest) -> AsyncIterator[PrefillResult]:
        yield await self.prefill(request)

    def _feed_commands(self) -> FeedCommands:
        start = {StartPrefill: lambda subscriber, command: self.start_prefill(subscriber, command.request)}
        return {**super()._feed_commands(), **start}
