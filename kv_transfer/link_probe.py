"""One real NIXL READ between a prefill and a decode engine's processes at start-up: what the
link between them carries, on the path KV takes (same backends, same UCX or libfabric
environment), before any request depends on it.

vLLM's NixlConnector owns the engines' agents and exposes no transfer of our own buffers, so
each side makes a small agent of its own for the probe and frees it afterwards. The buffer
is host memory, request-sized (`TransferConfig.link_probe_bytes`); the reader checks the
bytes it got.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import uuid
from dataclasses import dataclass
from typing import Any

DONE = b"pdserve-link-probe-done"


@dataclass(frozen=True, slots=True)
class LinkMeasurement:
    source: str  # the prefill engine read from
    reader: str  # the decode engine that read
    nbytes: int
    seconds: float

    @property
    def gbit_s(self) -> float:
        return self.nbytes * 8 / self.seconds / 1e9

    def summary(self) -> str:
        return f"{self.source} -> {self.reader}: {self.nbytes:,} B READ in {self.seconds * 1e3:,.1f} ms, " + (
            f"{self.gbit_s:,.2f} Gbit/s"
        )

    def warning(self, floor_gbit_s: float) -> str | None:
        if self.gbit_s >= floor_gbit_s:
            return None
        return (
            f"{self.source} -> {self.reader} moves {self.gbit_s:,.2f} Gbit/s, below --link-floor-gbits "
            f"{floor_gbit_s:g}: likely TCP where RDMA was meant (--fabric and --ucx-net-devices must name "
            "the cluster's NICs; check UCX_PROTO_INFO=y), a NIC or port down, or a capped or shared link"
        )


def _agent(backends: tuple[str, ...]) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(f"pdserve-probe-{uuid.uuid4().hex[:8]}", nixl_agent_config(False, backends=list(backends)))


def _pattern(nbytes: int) -> Any:
    import torch

    period = torch.arange(251, dtype=torch.uint8)  # a prime period: no block lines up with it
    return period.repeat(nbytes // 251 + 1)[:nbytes].clone()


class ProbeSource:
    """The prefill side: a registered buffer to be read, and the progress a READ over TCP
    needs from its target (UCX emulates it with messages the target must answer)."""

    def __init__(self, nbytes: int, backends: tuple[str, ...]) -> None:
        self._agent = _agent(backends)
        self._buffer = _pattern(nbytes)
        self._registered = self._agent.register_memory(self._agent.get_reg_descs([self._buffer], "DRAM"))
        descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs([self._buffer], "DRAM"))
        self.offer = pickle.dumps((self._agent.get_agent_metadata(), descs, nbytes))

    async def serve(self, timeout_s: float) -> bool:
        """Progress until the reader says it is done (True) or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if any(DONE in messages for messages in self._agent.get_new_notifs().values()):
                    return True
                await asyncio.sleep(0.0005)
            return False
        finally:
            self._agent.deregister_memory(self._registered)


async def read(offer: bytes, backends: tuple[str, ...], timeout_s: float) -> float:
    """The decode side: READ the offered buffer once; returns the seconds it took."""
    metadata, descs, nbytes = pickle.loads(offer)
    agent = _agent(backends)
    buffer = _pattern(nbytes).zero_()
    registered = agent.register_memory(agent.get_reg_descs([buffer], "DRAM"))
    peer = agent.add_remote_agent(metadata)
    try:
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs([buffer], "DRAM"), agent.deserialize_descs(descs), peer, DONE
        )
        start = time.perf_counter()
        state = agent.transfer(handle)
        deadline = time.monotonic() + timeout_s
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the link probe's READ of {nbytes:,} B did not finish in {timeout_s:.0f}s")
            await asyncio.sleep(0)
            state = agent.check_xfer_state(handle)
        seconds = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        if state == "ERR" or not bool((buffer == _pattern(nbytes)).all()):
            raise RuntimeError("the link probe's READ failed or returned other bytes than were offered")
        return seconds
    finally:
        agent.remove_remote_agent(peer)
        agent.deregister_memory(registered)
