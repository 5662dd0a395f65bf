"""NixlConnector configuration for each role, from one typed `TransferConfig`.

Which mechanisms are vLLM's and which are ours:
- vLLM NixlConnector (configured here): NIXL handshake with a compatibility hash, READ of
  attention blocks and DeltaNet state slots, the producer-side lease on finished requests
  (`kv_lease_duration`, extended by decode heartbeats), `kv_load_failure_policy`.
- ours: unique engine ids and side-channel ports per worker (many workers per host), the
  NIXL progress-thread setting (`kv_transfer.progress_thread`), handle expiry checks, byte
  accounting and transfer digests (kv_transfer.digest_connector, a NixlConnector subclass).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Iterator, Literal

from configuration.fields import knob
from configuration.parsers import parse_bytes
from kv_transfer.fabrics import FABRICS
from kv_transfer.layout import HYBRID_TRANSFER_ENV
from kv_transfer.progress_thread import PROGRESS_POLL_ENV


class Role(str, Enum):
    PREFILL = "kv_producer"
    DECODE = "kv_consumer"
    # Producer and consumer in one engine, so the controller can move it between the pools
    # without a restart. vLLM 0.32 warns this role is deprecated for NixlConnector, but its
    # connector only treats the roles differently under prefill context parallelism (not
    # used here): what a request does comes from its kv_transfer_params.
    EITHER = "kv_both"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    # Host memory (UCX over shared memory/TCP) or GPU memory (RDMA): where the engines live,
    # so the deployment sets it from the engines' device.
    kv_buffer_device: Literal["cpu", "cuda"] = knob("cpu", hidden=True, help="KV buffer memory")
    # Decode heartbeats extend the lease while a pull is in progress (vLLM's lease).
    lease_s: int = knob(30, flag="lease", help="seconds prefill holds a finished request's blocks for decode to read")
    load_failure_policy: Literal["fail", "recompute"] = knob(
        "fail",
        help="when decode cannot load the blocks: fail the request, or prefill locally (vLLM's kv_load_failure_policy)",
    )
    # Without a progress thread only the engine step drives transfers, so a pull waits behind
    # the producer's running prefill; NIXL's own thread (0) spins a full core.
    nixl_progress_poll_us: int | None = knob(
        10_000,
        parse=lambda text: None if text == "none" else int(text),
        help="NIXL progress thread: 'none', 0 (NIXL's spinning thread) or N >= 1000 (asleep in poll, N us at most)",
    )
    fabric: Literal["auto", "tcp", "efa", "infiniband", "roce"] = knob(
        "auto", help="the network NIXL moves state over: its backends and environment (docs/deploy.md#fabrics)"
    )
    backends: tuple[str, ...] | None = knob(None, help="NIXL backends, in order of preference (unset: the fabric's)")
    handle_margin_s: float = knob(
        1.0, help="decode refuses a handle with less lease left than this: its blocks could be freed mid-read"
    )
    # vLLM 0.32 has a handshake timeout but none on a READ from a live but stalled peer.
    transfer_timeout_s: float = knob(30.0, help="decode gives up on a pull that produced no first token in this long")
    ucx_transports: str | None = knob(None, help="UCX_TLS, e.g. 'tcp' (unset: the fabric's)")
    ucx_net_devices: str | None = knob(None, help="UCX_NET_DEVICES, e.g. 'mlx5_0:1,mlx5_1:1' (unset: UCX uses all)")
    # About a request's state: the seeds' 27B moves 294 MiB per 2,000-token request at TP 4.
    link_probe_bytes: int = knob(
        64 << 20,
        parse=parse_bytes,
        help="bytes each decode engine READs from each prefill engine at start-up, to measure the link (0: none)",
    )
    link_floor_gbit_s: float = knob(
        1.0, flag="link-floor-gbits", help="warn when a measured link is slower (an RDMA cluster: e.g. 100)"
    )
    # kv_transfer.digests; the cost per request is in docs/benchmarks.md.
    digest_fraction: float = knob(
        1.0,
        help="share of handoffs whose blocks and state decode checks against the producer's digests before "
        "running (0: none); a mismatch fails the load (load_failure_policy decides what follows)",
    )

    @property
    def nixl_backends(self) -> tuple[str, ...]:
        return self.backends or FABRICS[self.fabric].backends

    def fabric_warning(self, device: str) -> str | None:
        """Why this transfer setting may be slow for engines on `device`, if it may."""
        tcp_only = (self.ucx_transports or FABRICS[self.fabric].env.get("UCX_TLS", "")).split(",") == ["tcp"]
        if device == "cuda" and tcp_only and "UCX" in self.nixl_backends:
            return (
                "GPU engines with UCX over TCP only: KV and state go through host memory and the kernel's TCP "
                "stack, a fraction of an RDMA NIC's rate. Choose --fabric efa, infiniband or roce for the NICs"
            )
        return None

    def process_env(self) -> dict[str, str]:
        """Environment of every process of an engine with this transfer (read there by
        vllm_engine.vllm_plugin and by UCX)."""
        poll = self.nixl_progress_poll_us
        env = {**FABRICS[self.fabric].env, PROGRESS_POLL_ENV: "none" if poll is None else str(poll)}
        if self.ucx_transports:
            env["UCX_TLS"] = self.ucx_transports
        if self.ucx_net_devices:
            env["UCX_NET_DEVICES"] = self.ucx_net_devices
        return env

    def __post_init__(self) -> None:
        if self.nixl_progress_poll_us is not None and not (
            self.nixl_progress_poll_us == 0 or self.nixl_progress_poll_us >= 1000
        ):
            raise ValueError("nixl_progress_poll_us: None, 0 (spin) or >= 1000 (NIXL's poll timeout is whole ms)")
        if self.lease_s < 1:
            raise ValueError(f"lease_s must be >= 1, got {self.lease_s}")
        if not 0 <= self.handle_margin_s < self.lease_s:
            raise ValueError(f"handle_margin_s {self.handle_margin_s} must be in [0, lease_s {self.lease_s})")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s}")
        if self.link_probe_bytes < 0 or self.link_floor_gbit_s < 0:
            raise ValueError("link_probe_bytes and link_floor_gbit_s must be >= 0")
        if self.fabric not in FABRICS:
            raise ValueError(f"fabric {self.fabric!r}: one of {', '.join(FABRICS)}")
        if not 0 <= self.digest_fraction <= 1:
            raise ValueError(f"digest_fraction must be in [0, 1], got {self.digest_fraction}")
        if self.backends is not None and not self.backends:
            raise ValueError("backends: name at least one NIXL backend, e.g. UCX")

    def kv_transfer_config(self, role: Role, engine_id: str) -> Any:
        from vllm.config import KVTransferConfig

        return KVTransferConfig(
            kv_connector="DigestedNixlConnector",  # NixlConnector, checking transfer digests
            kv_connector_module_path="kv_transfer.digest_connector",
            kv_role=role.value,
            kv_buffer_device=self.kv_buffer_device,
            engine_id=engine_id,
            kv_load_failure_policy=self.load_failure_policy,
            kv_connector_extra_config={
                "kv_lease_duration": self.lease_s,
                "backends": list(self.nixl_backends),
            },
        )


@dataclass(frozen=True, slots=True)
class SideChannel:
    """Where a producer's NIXL handshake listener is reachable. Unique per worker."""

    host: str
    port: int

    def process_env(self) -> dict[str, str]:
        return {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            **HYBRID_TRANSFER_ENV,
        }


def prefill_backoff(vllm_config: Any) -> int:
    """Trailing prompt tokens NixlConnector's producer leaves for its consumer to compute, as
    vLLM 0.32 counts them (`NixlConnectorScheduler._prefill_backoff`): 1 on models with a
    recurrent (Mamba-family) state, which must stop before the last prompt token because it
    cannot be rewound; with a multi-module MTP draft, its lookahead less one (the drafts
    prefill would embed in those layers' KV); else 0. A handle for N prompt tokens is
    decoded with N + this many."""
    model_config = vllm_config.model_config
    recurrent = int(model_config.is_hybrid or model_config.is_attention_free)
    return max(recurrent, vllm_config.num_prefill_lookahead_tokens - 1)


def engine_id_for(role: Role, worker_name: str, channel: SideChannel) -> str:
    # Stable across restarts of the same worker identity, distinct across workers/hosts.
    return f"{role.name.lower()}-{worker_name}-{channel.host}-{channel.port}"


@contextmanager
def reserved_side_channel(host: str) -> Iterator[SideChannel]:
    """A free port on `host` for a worker's NIXL handshake listener, held until the engine's
    listener has bound it. A port picked free and let go at once stayed free only by luck
    through the engine's start (vLLM's imports, seconds), while the host's other sockets asked
    for free ports too: on a multi-host run one took it and the listener failed with "Address
    already in use". Held by a bound socket that does not listen, the port is given to no
    socket asking the kernel for a free one and to no outgoing connection; the listener's own
    bind succeeds, as both sockets set SO_REUSEADDR and neither listens yet. (vLLM hands a
    bound socket itself to ZMQ elsewhere, `make_zmq_socket(listener=...)`; NixlConnector's
    handshake listener takes only an address, from VLLM_NIXL_SIDE_CHANNEL_PORT.)"""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        yield SideChannel(host, sock.getsockname()[1])
