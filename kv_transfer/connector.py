"""One engine's connector, built once from its `Role`: what the engine starts with, and the
halves of the transfer policy that role runs (as vLLM's NixlConnector builds only the
scheduler or worker half its role needs)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from kv_transfer.connector_config import Role, SideChannel, TransferConfig, engine_id_for, reserved_side_channel
from kv_transfer.consumer import TransferConsumer
from kv_transfer.producer import TransferProducer


@dataclass(frozen=True, slots=True)
class Connector:
    role: Role
    engine_id: str  # NIXL identity; a restarted worker gets a new one
    transfer: TransferConfig
    channel: SideChannel

    @classmethod
    @contextmanager
    def for_worker(cls, role: Role, worker_name: str, transfer: TransferConfig, host: str) -> Iterator[Connector]:
        """With a free NIXL side-channel port on `host`, the worker's node address, held for
        the engine until the block ends: start the engine inside it."""
        with reserved_side_channel(host) as channel:
            yield cls(role, engine_id_for(role, worker_name, channel), transfer, channel)

    def kv_transfer_config(self) -> Any:
        return self.transfer.kv_transfer_config(self.role, self.engine_id)

    def process_env(self) -> dict[str, str]:
        return {**self.channel.process_env(), **self.transfer.process_env()}

    def halves(self, prefill_backoff: int) -> tuple[TransferProducer | None, TransferConsumer | None]:
        """(producer, consumer), None for the half this role does not run; `prefill_backoff`
        is the started engine's."""
        produces = self.role in (Role.PREFILL, Role.EITHER)
        consumes = self.role in (Role.DECODE, Role.EITHER)
        return (
            TransferProducer(self.transfer, prefill_backoff) if produces else None,
            TransferConsumer(self.transfer, prefill_backoff) if consumes else None,
        )
