"""Producer half of the transfer policy: what a prefill leg asks of its engine, and how its
result becomes a `TransferHandle`.

Who computes the first output token. vLLM's NixlConnector on a hybrid stops prefill one
prompt token short (the recurrent state cannot be rewound, so decode must be handed the
state before the last token) and decode computes that last token: the first output then
waits for the handoff, the pull and a decode step. Where that is the connector's only
holdback, pdserve's prefill computes the whole prompt and samples the first token itself,
with the request's own sampling settings, as SGLang's prefill does: the router streams it
at once, and decode runs prompt + that token on the state after the prompt, which the
connector's own rule (load all but the last token) already fits. Requests whose settings
look at the whole output (stop strings, bad words, presence/frequency penalties, a seed, a
structured output: SamplingConfig.decoded_whole) keep the connector's split, since decode's
checks only see what decode samples; there the token prefill samples is greedy and dropped.
A structured output's constraint stays on that leg, so prefill's engine refuses one that does
not compile before it computes the prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from kv_transfer.connector_config import TransferConfig
from kv_transfer.digests import DIGESTS_KEY
from kv_transfer.layout import StateLayout
from kv_transfer.metrics import LEASES_GRANTED
from messages.errors import PrefillFailedError
from messages.requests import GenerateRequest
from messages.transfer import TransferHandle

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class PrefillLeg:
    """How one request's prefill runs on the producer engine."""

    # Sampling settings over the request's own (vllm_engine.sampling.sampling_params).
    overrides: Mapping[str, Any]
    # The token prefill samples is the request's first output (else decode computes it).
    samples_first: bool


class TransferProducer:
    """Run by engines that prefill for remote decode (`Role.PREFILL`, `Role.EITHER`)."""

    def __init__(self, transfer: TransferConfig, prefill_backoff: int) -> None:
        """`prefill_backoff`: the engine's (kv_transfer.connector_config.prefill_backoff)."""
        self._transfer = transfer
        self._prefill_backoff = prefill_backoff
        self._sample = random.Random()

    def leg(self, request: GenerateRequest) -> PrefillLeg:
        if self._prefill_backoff == 1 and not request.sampling.decoded_whole:
            # vLLM's own guard against cutting a request twice: here it is never cut.
            transfer = {"do_remote_decode": True, "_p_side_truncated": True}
            return PrefillLeg({"max_tokens": 1, "extra_args": {"kv_transfer_params": transfer}}, samples_first=True)
        # The connector's split: the token sampled here is dropped (greedy, no stop rules).
        overrides = {
            "max_tokens": 1,
            "temperature": 0.0,
            "stop": [],
            "stop_token_ids": [],
            "ignore_eos": True,
            "logprobs": None,
            "extra_args": {"kv_transfer_params": {"do_remote_decode": True}},
        }
        return PrefillLeg(overrides, samples_first=False)

    def held_params(self, request_id: str, final: RequestOutput | None) -> dict[str, Any]:
        """The connector params of the blocks the engine holds for decode after the leg's
        last output; a leg that ended without them failed.

        A stop token ends the request as the end of max_tokens does: vLLM holds the blocks
        for decode either way, and the router releases them."""
        if final is None or final.kv_transfer_params is None:
            reason = final.outputs[0].finish_reason if final else "no output"
            raise PrefillFailedError(f"prefill of {request_id} produced no transfer handle ({reason})")
        return final.kv_transfer_params

    def wants_digests(self) -> bool:
        """Whether this handoff carries digests of what it holds (TransferConfig.digest_fraction)."""
        return self._sample.random() < self._transfer.digest_fraction

    @staticmethod
    def with_digests(connector_params: dict[str, Any], per_rank: Sequence[Any]) -> dict[str, Any]:
        """The params decode's engine gets, with every rank's digests of the held blocks
        (vllm_engine.worker_extension `pdserve_transfer_digests`, in rank order)."""
        return {**connector_params, DIGESTS_KEY: list(per_rank)}

    def grant(self, connector_params: dict[str, Any], layout: StateLayout) -> TransferHandle:
        """A lease on the held blocks, as the handle the router carries to decode; `layout`
        counts every rank's share of the bytes."""
        handle = TransferHandle.from_connector_params(
            connector_params,
            lease_s=self._transfer.lease_s,
            transfer_bytes=layout.bytes_for(connector_params["remote_block_ids"]),
        )
        LEASES_GRANTED.inc()
        return handle

    @staticmethod
    def first_finish_reason(request: GenerateRequest, finish_reason: str | None) -> str | None:
        """The sampled first token's finish reason: set only where that token ends the
        request (then nothing is decoded)."""
        ended = finish_reason == "stop" or request.sampling.max_tokens == 1
        return finish_reason if ended else None
