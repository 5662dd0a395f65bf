"""Consumer half of the transfer policy: whether a handle can be decoded here, what the engine
is given to pull its state, and when a pull counts as failed."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator

from kv_transfer.connector_config import TransferConfig
from kv_transfer.metrics import STATE_BYTES
from messages.errors import InvalidRequestError, TransferFailedError
from messages.requests import GenerateRequest
from messages.transfer import TransferHandle

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput


class TransferConsumer:
    """Run by engines that decode pulled state (`Role.DECODE`, `Role.EITHER`)."""

    def __init__(self, transfer: TransferConfig, prefill_backoff: int) -> None:
        """`prefill_backoff`: the engine's (kv_transfer.connector_config.prefill_backoff)."""
        self._transfer = transfer
        self._prefill_backoff = prefill_backoff

    def pull_args(self, request: GenerateRequest, handle: TransferHandle) -> dict[str, Any]:
        """The sampling `extra_args` that make the engine pull `handle`'s state for `request`;
        refuses a handle about to expire or one that does not fit the prompt."""
        handle.check_usable(self._transfer.handle_margin_s)
        expected = handle.num_tokens + self._prefill_backoff
        if len(request.prompt_token_ids) != expected:
            raise InvalidRequestError(
                "prompt",
                f"has {len(request.prompt_token_ids)} tokens but the handle holds the state of "
                f"{handle.num_tokens}: decode the prompt it was prefilled from, plus the first "
                "token if prefill sampled it (PrefillResult.decode_leg)",
            )
        return {"kv_transfer_params": handle.connector_params}

    async def pulled(
        self, handle: TransferHandle, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for a request decoding from `handle`: the first needs the
        pulled state, so it fails the pull if late, and it counts the bytes pulled.

        On timeout the engine's generator is cancelled, which aborts the request there."""
        timeout_s = self._transfer.transfer_timeout_s
        try:
            first = await asyncio.wait_for(anext(outputs), timeout_s)
        except asyncio.TimeoutError:
            raise TransferFailedError(
                f"request {handle.request_id}: no KV blocks / DeltaNet state from {handle.engine_id} "
                f"within {timeout_s:.0f}s (producer stalled or unreachable)"
            ) from None
        STATE_BYTES.labels("attention_kv").inc(handle.bytes.attention_kv)
        STATE_BYTES.labels("deltanet_state").inc(handle.bytes.deltanet_state)
        yield first
        async for output in outputs:
            yield output


def check_loaded(request_id: str, finish_reason: str | None, handle: TransferHandle | None) -> None:
    """vLLM ends a request whose transferred state it could not load with finish reason
    "error" (`kv_load_failure_policy="fail"`): that is a failed transfer."""
    if finish_reason == "error":
        raise TransferFailedError(
            f"request {request_id}: decode could not load its KV blocks / DeltaNet "
            f"state from {handle.engine_id if handle else 'its producer'} "
            "(producer gone, blocks expired or handle invalid)"
        )
