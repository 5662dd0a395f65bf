"""The typed handle the router carries from the prefill worker to the decode worker, and
the bytes a transfer moves."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from messages.errors import HandleExpiredError


@dataclass(frozen=True, slots=True)
class TransferBytes:
    attention_kv: int
    deltanet_state: int

    @property
    def total(self) -> int:
        return self.attention_kv + self.deltanet_state


@dataclass(frozen=True, slots=True)
class TransferHandle:
    request_id: str  # the producer engine's id for the request
    engine_id: str  # producer engine (NIXL peer) that holds the blocks
    host: str  # producer's NIXL side-channel address
    port: int
    # Block ids per KV-cache group, in the producer's group order: one DeltaNet state slot
    # per DeltaNet group, then the attention blocks.
    block_ids: tuple[tuple[int, ...], ...]
    # Prompt tokens whose state the blocks hold: all N where prefill sampled the first
    # token, N-1 on hybrids where decode computes it (kv_transfer/producer.py).
    num_tokens: int
    lease_expires_at: float  # wall-clock time after which the producer may free the blocks
    bytes: TransferBytes
    # vLLM's kv_transfer_params exactly as the producer returned them; decode hands them
    # back to its engine untouched so NixlConnector sees every field it expects.
    connector_params: dict[str, Any]

    @classmethod
    def from_connector_params(
        cls, params: dict[str, Any], lease_s: float, transfer_bytes: TransferBytes
    ) -> "TransferHandle":
        return cls(
            request_id=params["remote_request_id"],
            engine_id=params["remote_engine_id"],
            host=params["remote_host"],
            port=int(params["remote_port"]),
            block_ids=tuple(tuple(ids) for ids in params["remote_block_ids"]),
            num_tokens=int(params.get("remote_num_tokens", 0)),
            lease_expires_at=time.time() + lease_s,
            bytes=transfer_bytes,
            connector_params=dict(params),
        )

    def seconds_left(self, now: float | None = None) -> float:
        return self.lease_expires_at - (time.time() if now is None else now)

    def check_usable(self, margin_s: float) -> None:
        """Refuse a handle whose blocks may be freed before the read completes."""
        left = self.seconds_left()
        if left < margin_s:
            raise HandleExpiredError(
                f"transfer handle for request {self.request_id} on engine {self.engine_id} "
                f"{'expired' if left <= 0 else 'expires'} ({left:.2f}s left, need {margin_s:.2f}s): "
                "its blocks may already be freed; run prefill again"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TransferHandle":
        fields = dict(data)
        fields["block_ids"] = tuple(tuple(ids) for ids in fields["block_ids"])
        fields["bytes"] = TransferBytes(**fields["bytes"])
        return cls(**fields)
