"""One vLLM engine in the KV-producer role.

For each request it runs prefill and returns a `TransferHandle`; the engine keeps the
request's attention blocks and DeltaNet state slots until decode has read them or the lease
runs out. The token prefill samples is never an output: on hybrids prefill computes only
N-1 prompt tokens (the recurrent state must stop before the last one) and decode computes
the real first token, so we sample it greedily and drop it.
"""

from __future__ import annotations

import time
from typing import Callable

from kv_transfer.connector_config import (
    Role,
    SideChannel,
    TransferConfig,
    engine_id_for,
)
from kv_transfer.metrics import LEASES_GRANTED, TransferStatLogger
from messages.errors import PrefillFailedError
from messages.requests import GenerateRequest
from messages.results import PrefillResult
from messages.transfer import TransferHandle
from vllm_engine.config import EngineConfig
from vllm_engine.engine import Engine
from vllm_engine.sampling import sampling_params
from vllm_engine.worker_base import EngineWorker


class PrefillDuty:
    """What a producer engine does with each request; shared by the prefill worker and the
    either-role worker (decode_worker/either_role.py)."""

    _engine: Engine
    _transfer: TransferConfig

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        request.validate(self._engine.limits)
        started = time.perf_counter()
        params = sampling_params(
            request.sampling,
            max_tokens=1,
            temperature=0.0,
            stop=[],
            stop_token_ids=[],
            ignore_eos=True,
            logprobs=None,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        final = None
        async for output in self._engine.generate(request.request_id, list(request.prompt_token_ids), params):
            final = output
        if final is None or final.kv_transfer_params is None:
            reason = final.outputs[0].finish_reason if final else "no output"
            raise PrefillFailedError(f"prefill of {request.request_id} produced no transfer handle ({reason})")
        connector_params = final.kv_transfer_params
        layout = await self._engine.state_layout()  # every rank's share of the blocks
        handle = TransferHandle.from_connector_params(
            connector_params,
            lease_s=self._transfer.lease_s,
            transfer_bytes=layout.bytes_for(connector_params["remote_block_ids"]),
        )
        LEASES_GRANTED.inc()
        return PrefillResult(handle, time.perf_counter() - started)


class PrefillWorker(PrefillDuty, EngineWorker):
    def __init__(
        self,
        name: str,
        engine_config: EngineConfig,
        transfer: TransferConfig,
        channel: SideChannel,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self.engine_id = engine_id_for(Role.PREFILL, name, channel)
        self._transfer = transfer
        self._start_engine(
            engine_config,
            transfer.kv_transfer_config(Role.PREFILL, self.engine_id),
            {**channel.process_env(), **transfer.process_env()},
            on_fatal,
            [TransferStatLogger],
        )
