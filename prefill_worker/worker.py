"""One vLLM engine in the KV-producer role.

For each request it runs prefill and returns a `TransferHandle`; the engine keeps the
request's attention blocks and DeltaNet state slots until decode has read them or the lease
runs out.

Who computes the first output token. vLLM's NixlConnector on a hybrid stops prefill one
prompt token short (the recurrent state cannot be rewound, so decode must be handed the
state before the last token) and decode computes that last token: the first output then
waits for the handoff, the pull and a decode step. Where that is the connector's only
holdback, pdserve's prefill computes the whole prompt and samples the first token itself,
with the request's own sampling settings, as SGLang's prefill does: the router streams it
at once, and decode runs prompt + that token on the state after the prompt, which the
connector's own rule (load all but the last token) already fits. Requests with stop
strings keep the connector's split: a stop string could span the first token and the
next ones, which decode's check would not see; there the token prefill samples is greedy
and dropped.
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
from vllm_engine.sampling import sampling_params, token_chunk
from vllm_engine.worker_base import EngineWorker


class PrefillDuty:
    """What a producer engine does with each request; shared by the prefill worker and the
    either-role worker (decode_worker/either_role.py)."""

    _engine: Engine
    _transfer: TransferConfig

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        request.validate(self._engine.limits)
        started = time.perf_counter()
        samples_first = self._engine.prefill_backoff == 1 and not request.sampling.stop
        if samples_first:
            # vLLM's own guard against cutting a request twice: here it is never cut.
            transfer = {"do_remote_decode": True, "_p_side_truncated": True}
            params = sampling_params(request.sampling, max_tokens=1, extra_args={"kv_transfer_params": transfer})
        else:
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
        # A stop token ends the request as the end of max_tokens does: vLLM holds the blocks
        # for decode either way, and the router releases them.
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
        first = None
        if samples_first:
            completion = final.outputs[0]
            ended = completion.finish_reason == "stop" or request.sampling.max_tokens == 1
            first = token_chunk(completion, completion.finish_reason if ended else None)
        return PrefillResult(handle, time.perf_counter() - started, first)


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
