"""NIXL READ of one hybrid-model request between two processes, against in-process copy.

A consumer process (the decode side) pulls one request's state from a producer process (the
prefill side) with a single NIXL READ, as vLLM's NixlConnector does, and compares the
bandwidth with copying the same bytes inside one process in the same run.

Layout per side, with Qwen3.5-27B's layer shapes:

- Attention, 16 full-attention layers: K+V in bf16, 4 KV heads x head dim 256, so
  2 x 4 x 256 x 2 B = 4 KiB per token per layer, 64 KiB per token over the 16 layers.
  Paged as in vLLM: per layer one registered pool of 16-token blocks of 64 KiB
  ([blocks, 2, 16, 4, 256] bf16); a request's blocks are scattered over the pool in random
  order, on each side independently.
- Gated DeltaNet, 48 linear-attention layers, per layer a pool of state slots and one slot
  per request:
  - temporal state, fp32 [48 value heads, 128 key dim, 128 value dim] = 3 MiB per layer,
    144 MiB in all;
  - conv state, bf16 [kernel 4 - 1, conv channels], conv channels = 16 key heads x 128 x 2
    (q, k) + 48 value heads x 128 (v) = 10240, so 60 KiB per layer.
- One READ per request: one descriptor per (attention layer, block) plus one conv and one
  temporal descriptor per DeltaNet layer, 16 x tokens / 16 + 96 descriptors, moving
  tokens x 64 KiB + 48 x (3 MiB + 60 KiB) bytes.

Each transport setting (UCX defaults, TCP only) gets its own pair of spawned processes,
because UCX reads its environment when NIXL loads. NIXL's progress thread is off (it
busy-polls a core): the consumer polls the transfer state, the producer polls for the
completion notification, and every wait has a deadline. Pulled bytes are checked against
the producer's checksum. Pools are allocated once, for the longest prompt plus slack: about
2.9 GiB per side at 32k tokens. Prints a table and writes bench/results/nixl_transfer.json.

Seen here: with UCX's defaults the READ goes over cma (process_vm_readv) and completes
inside the post call; with TCP only, UCX emulates GET in software over active messages.
The in-process baseline is a single-threaded gather by index of the same bytes.

    python -m bench.nixl_transfer [--lengths 1024 ... 32768] [--reps 5] [--transports default tcp veth-tcp]

`veth-tcp` puts the two processes in network namespaces of their own, joined by a veth pair
(root only; `--link-cap 1gbit` adds a tbf cap): TCP over a link between two network stacks, as
between hosts, where plain `tcp` between two processes of one namespace rides loopback.
`veth-default` leaves UCX its pick there: on one kernel it still reads over shared memory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any

import numpy as np
import torch

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
RESULTS_PATH = Path(__file__).parent / "results" / "nixl_transfer.json"
# Issue 4: at 32k tokens over UCX's default transports, reach half the in-process copy rate.
TARGET_TOKENS = 32768
TARGET_TRANSPORT = "default"
TARGET_RATIO = 0.5


@dataclass(frozen=True, slots=True)
class HybridLayout:
    """Bytes of one request's transferable state (Qwen3.5-27B)."""

    attention_layers: int = 16
    block_tokens: int = 16
    kv_bytes_per_token_per_layer: int = 2 * 4 * 256 * 2  # (K, V) x KV heads x head dim x bf16
    deltanet_layers: int = 48
    conv_state_bytes: int = (4 - 1) * (16 * 128 * 2 + 48 * 128) * 2  # (kernel - 1) x channels x bf16
    temporal_state_bytes: int = 48 * 128 * 128 * 4  # value heads x key dim x value dim x fp32

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.kv_bytes_per_token_per_layer

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def attention_bytes(self, tokens: int) -> int:
        return self.attention_layers * self.blocks_for(tokens) * self.block_bytes

    @property
    def state_bytes(self) -> int:
        return self.deltanet_layers * (self.conv_state_bytes + self.temporal_state_bytes)

    def descriptors(self, tokens: int) -> int:
        return self.attention_layers * self.blocks_for(tokens) + 2 * self.deltanet_layers


@dataclass(frozen=True, slots=True)
class Transport:
    name: str
    ucx_tls: str | None  # None leaves UCX_TLS unset: UCX picks (cma for data + TCP here)
    # Each process in a network namespace of its own, joined by a veth pair: the TCP path of
    # two hosts (their own network stacks and link) on one kernel.
    across_link: bool = False


TRANSPORTS = {
    "default": Transport("default", None),
    "tcp": Transport("tcp", "tcp"),
    "veth-tcp": Transport("veth-tcp", "tcp", across_link=True),
    # What UCX picks across the link: on one kernel it still finds shared memory (cma), which
    # hosts would not have.
    "veth-default": Transport("veth-default", None, across_link=True),
}


@dataclass(frozen=True, slots=True)
class BenchConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768)
    reps: int = 5
    transports: tuple[Transport, ...] = (TRANSPORTS["default"], TRANSPORTS["tcp"])
    layout: HybridLayout = field(default_factory=HybridLayout)
    pool_slack: float = 0.125  # pool holds this much more than the largest request
    state_slots: int = 4
    transfer_timeout_s: float = 60.0  # one READ, posted to DONE
    reply_timeout_s: float = 180.0  # any other wait: process setup, a command, a notification
    poll_interval_s: float = 50e-6  # between progress calls; 0 spins a core for no gain
    # In-process copy threads. One, like the transfer (UCX copies on the polling thread);
    # on this shared 2-core box two OpenMP threads stalled at barriers, 10-100x slower.
    copy_threads: int = 1
    link_cap: str | None = None  # veth-tcp: a `tc tbf` rate on the link, e.g. "1gbit"
    seed: int = 0

    @property
    def pool_blocks(self) -> int:
        return int(self.layout.blocks_for(max(self.lengths)) * (1 + self.pool_slack)) + 1


@dataclass(frozen=True, slots=True)
class RequestKey:
    tokens: int
    rep: int  # -1: warm-up, not reported

    @property
    def tag(self) -> bytes:
        return f"req-{self.tokens}-{self.rep}".encode()


@dataclass(frozen=True, slots=True)
class Staged:
    """The producer's side of one request: where its bytes are and what they sum to."""

    key: RequestKey
    descs: np.ndarray  # (address, length, device) rows in transfer order
    digest: str


@dataclass(frozen=True, slots=True)
class Sample:
    """One repetition, measured in the consumer."""

    transfer_s: float  # posted to DONE
    prep_s: float  # building the descriptor lists and initialize_xfer
    copy_s: float  # in-process gather of the same bytes
    attention_bytes: int
    state_bytes: int
    descriptors: int
    intact: bool


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    prompt_tokens: int
    attention_kv_bytes: int
    deltanet_state_bytes: int
    descriptors: int
    reps: int
    transfer_ms: float  # median
    transfer_ms_each: tuple[float, ...]
    prep_ms: float  # median
    gib_per_s: float
    copy_gib_per_s: float
    ratio: float  # NIXL / in-process copy
    intact: bool  # every repetition

    @property
    def total_bytes(self) -> int:
        return self.attention_kv_bytes + self.deltanet_state_bytes


@dataclass(frozen=True, slots=True)
class Report:
    rows: tuple[Row, ...]
    target_ratio: float | None  # ratio at the target point; None if not measured
    target_met: bool | None


# ---- both sides -------------------------------------------------------------------------


def _placement(config: BenchConfig, key: RequestKey, side: int) -> tuple[np.ndarray, int]:
    """Random block ids (shuffled, as in a long-running cache) and one state slot."""
    rng = np.random.default_rng([config.seed, side, key.tokens, key.rep + 1])  # warm-up is rep -1; seeds must be >= 0
    ids = rng.choice(config.pool_blocks, config.layout.blocks_for(key.tokens), replace=False)
    return ids.astype(np.int64), int(rng.integers(config.state_slots))


def _desc_rows(regions: list[torch.Tensor], index: np.ndarray, stride: int) -> np.ndarray:
    """(address, length, device) of entries `index` of each region, region-major."""
    bases = np.array([t.data_ptr() for t in regions], dtype=np.uint64)
    addresses = (bases[:, None] + index.astype(np.uint64)[None, :] * np.uint64(stride)).ravel()
    return np.stack(
        [addresses, np.full_like(addresses, stride), np.zeros_like(addresses)], axis=1
    )


class _Pools:
    """One side's cache: per attention layer a block pool, per DeltaNet layer conv and
    temporal slot pools; each a separate registered region, as in vLLM."""

    def __init__(self, config: BenchConfig) -> None:
        layout = config.layout
        self.layout = layout
        # torch.zeros touches every page now, so no page faults land in a measurement.
        self.attention = [
            torch.zeros((config.pool_blocks, layout.block_bytes), dtype=torch.uint8)
            for _ in range(layout.attention_layers)
        ]
        self.conv = [
            torch.zeros((config.state_slots, layout.conv_state_bytes), dtype=torch.uint8)
            for _ in range(layout.deltanet_layers)
        ]
        self.temporal = [
            torch.zeros((config.state_slots, layout.temporal_state_bytes), dtype=torch.uint8)
            for _ in range(layout.deltanet_layers)
        ]

    @property
    def regions(self) -> list[torch.Tensor]:
        return [*self.attention, *self.conv, *self.temporal]

    def fill_random(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for region in self.regions:
            region.view(torch.int64).random_(generator=generator)

    def descs(self, ids: np.ndarray, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Descriptor rows for attention (layer, block) and for DeltaNet state."""
        slots = np.array([slot])
        attention = _desc_rows(self.attention, ids, self.layout.block_bytes)
        state = np.concatenate(
            [
                _desc_rows(self.conv, slots, self.layout.conv_state_bytes),
                _desc_rows(self.temporal, slots, self.layout.temporal_state_bytes),
            ]
        )
        return attention, state

    def digest(self, ids: np.ndarray, slot: int) -> str:
        """Hash of per-block/slot uint64 sums in transfer order: catches missing, zeroed
        or misplaced blocks. Summing whole pools is cheaper than gathering the blocks."""
        hasher = hashlib.sha256()
        for regions, index in ((self.attention, ids), (self.conv, [slot]), (self.temporal, [slot])):
            for region in regions:
                sums = region.numpy().view(np.uint64).sum(axis=1, dtype=np.uint64)
                hasher.update(sums[index].tobytes())
        return hasher.hexdigest()

    def poison(self, ids: np.ndarray, slot: int) -> None:
        """Zero the destination, so bytes left over from an earlier pull cannot pass."""
        index = torch.from_numpy(ids)
        for region in self.attention:
            region.view(torch.int64).index_fill_(0, index, 0)
        for region in (*self.conv, *self.temporal):
            region[slot].zero_()


class _Scratch:
    """Preallocated destination of the in-process copy. One request's worth of one
    attention layer, reused per layer: a full second pool would double the memory."""

    def __init__(self, config: BenchConfig) -> None:
        layout = config.layout
        blocks = layout.blocks_for(max(config.lengths))
        self.attention = torch.zeros((blocks, layout.block_bytes), dtype=torch.uint8)
        self.conv = torch.zeros((layout.deltanet_layers, layout.conv_state_bytes), dtype=torch.uint8)
        self.temporal = torch.zeros(
            (layout.deltanet_layers, layout.temporal_state_bytes), dtype=torch.uint8
        )

    def gather_seconds(self, pools: _Pools, ids: np.ndarray, slot: int) -> float:
        """Time copying the request's bytes out of the pools by index (the box's limit)."""
        index = torch.from_numpy(ids)
        out = self.attention[: len(ids)]
        start = time.perf_counter()
        for region in pools.attention:
            torch.index_select(region, 0, index, out=out)
        for layer, region in enumerate(pools.conv):
            self.conv[layer].copy_(region[slot])
        for layer, region in enumerate(pools.temporal):
            self.temporal[layer].copy_(region[slot])
        return time.perf_counter() - start


def _new_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


# ---- producer (prefill side) ------------------------------------------------------------


class _Producer:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.agent = _new_agent("producer")
        self.pools = _Pools(config)
        self.pools.fill_random(config.seed)
        self.agent.register_memory(self.pools.regions)

    def hello(self) -> bytes:
        return self.agent.get_agent_metadata()

    def stage(self, key: RequestKey) -> Staged:
        ids, slot = _placement(self.config, key, side=0)
        attention, state = self.pools.descs(ids, slot)
        return Staged(key, np.concatenate([attention, state]), self.pools.digest(ids, slot))

    def serve(self, tag: bytes) -> None:
        """Progress the agent until the consumer's completion notification arrives: with the
        progress thread off, only these calls move the target side (needed over TCP)."""
        deadline = time.monotonic() + self.config.reply_timeout_s
        while time.monotonic() < deadline:
            if any(tag in messages for messages in self.agent.get_new_notifs().values()):
                return
            time.sleep(self.config.poll_interval_s)
        raise TimeoutError(f"no completion notification {tag!r} within {self.config.reply_timeout_s}s")


# ---- consumer (decode side) -------------------------------------------------------------


class _Consumer:
    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.agent = _new_agent("consumer")
        self.pools = _Pools(config)
        self.scratch = _Scratch(config)
        self.agent.register_memory(self.pools.regions)
        self.peer = ""

    def hello(self) -> bytes:
        return self.agent.get_agent_metadata()

    def connect(self, metadata: bytes) -> None:
        self.peer = self.agent.add_remote_agent(metadata)

    def pull(self, staged: Staged) -> Sample:
        ids, slot = _placement(self.config, staged.key, side=1)
        self.pools.poison(ids, slot)
        start = time.perf_counter()
        attention, state = self.pools.descs(ids, slot)
        local = np.concatenate([attention, state])
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, "DRAM"),
            self.agent.get_xfer_descs(staged.descs, "DRAM"),
            self.peer,
        )
        prep_s = time.perf_counter() - start
        transfer_s = self._run(handle, staged.key.tag)
        intact = self.pools.digest(ids, slot) == staged.digest
        return Sample(
            transfer_s=transfer_s,
            prep_s=prep_s,
            copy_s=self.scratch.gather_seconds(self.pools, ids, slot),
            attention_bytes=int(attention[:, 1].sum()),
            state_bytes=int(state[:, 1].sum()),
            descriptors=len(local),
            intact=intact,
        )

    def _run(self, handle: Any, tag: bytes) -> float:
        """Post the READ and poll it to DONE within the deadline; seconds taken."""
        start = time.perf_counter()
        deadline = start + self.config.transfer_timeout_s
        state = self.agent.transfer(handle, tag)
        while state == "PROC" and time.perf_counter() < deadline:
            time.sleep(self.config.poll_interval_s)
            state = self.agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        if state != "DONE":
            _abandon(self.agent, handle)
            raise TimeoutError(f"READ {tag!r} ended in state {state} after {elapsed:.1f}s")
        self.agent.release_xfer_handle(handle)
        return elapsed


def _abandon(agent: Any, handle: Any) -> None:
    """Release an unfinished transfer; NIXL aborts it and may raise, which adds nothing."""
    with contextlib.suppress(Exception):
        agent.release_xfer_handle(handle)


# ---- processes --------------------------------------------------------------------------


def _set_ucx_env(transport: Transport) -> None:
    if transport.ucx_tls is None:
        os.environ.pop("UCX_TLS", None)
    else:
        os.environ["UCX_TLS"] = transport.ucx_tls


def _child_main(
    conn: Connection, role: str, transport: Transport, config: BenchConfig, netns: str | None = None
) -> None:
    """Serve the parent's commands; UCX's environment is set (and the process moved into its
    network namespace) before NIXL is imported."""
    if netns is not None:
        _enter_netns(netns)
        if transport.ucx_tls is not None:  # its TCP on the link, not loopback
            os.environ["UCX_NET_DEVICES"] = VethLink.DEVICE
    _set_ucx_env(transport)
    torch.set_num_threads(config.copy_threads)
    try:
        side = _Producer(config) if role == "producer" else _Consumer(config)
        conn.send(("ok", side.hello()))
        # A bounded idle wait: a child whose parent vanished exits instead of lingering.
        while conn.poll(config.reply_timeout_s):
            command, argument = conn.recv()
            if command == "stop":
                return
            conn.send(("ok", getattr(side, command)(argument)))
    except Exception:  # noqa: BLE001 - any failure goes to the parent, which raises it
        conn.send(("error", traceback.format_exc()))


class _Peer:
    """The parent's handle on one child process: commands over a pipe, every wait bounded."""

    def __init__(
        self, ctx: SpawnContext, role: str, transport: Transport, config: BenchConfig, netns: str | None = None
    ):
        self.role = role
        self.timeout_s = config.reply_timeout_s
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main,
            args=(child_conn, role, transport, config, netns),
            name=f"nixl-bench-{role}-{transport.name}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()

    def send(self, command: str, argument: Any = None) -> None:
        self.conn.send((command, argument))

    def reply(self) -> Any:
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"{self.role}: no reply within {self.timeout_s}s")
        status, value = self.conn.recv()
        if status == "error":
            raise RuntimeError(f"{self.role} failed:\n{value}")
        return value

    def call(self, command: str, argument: Any = None) -> Any:
        self.send(command, argument)
        return self.reply()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the child may be gone already
            self.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def _pull_once(producer: _Peer, consumer: _Peer, key: RequestKey) -> Sample:
    staged = producer.call("stage", key)
    producer.send("serve", key.tag)
    sample = consumer.call("pull", staged)
    producer.reply()
    return sample


def _run_transport(config: BenchConfig, transport: Transport) -> dict[int, list[Sample]]:
    if not transport.across_link:
        return _run_pair(config, transport)
    with VethLink(config.link_cap) as link:
        return _run_pair(config, transport, link)


def _run_pair(config: BenchConfig, transport: Transport, link: "VethLink | None" = None) -> dict[int, list[Sample]]:
    """One producer/consumer pair; repetitions interleave the lengths so noise spreads."""
    ctx = mp.get_context("spawn")
    producer = _Peer(ctx, "producer", transport, config, link.producer if link else None)
    consumer = _Peer(ctx, "consumer", transport, config, link.consumer if link else None)
    try:
        metadata = producer.reply()
        consumer.reply()
        consumer.call("connect", metadata)
        _pull_once(producer, consumer, RequestKey(min(config.lengths), -1))  # connection set-up
        samples: dict[int, list[Sample]] = {tokens: [] for tokens in config.lengths}
        for rep in range(config.reps):
            for tokens in config.lengths:
                samples[tokens].append(_pull_once(producer, consumer, RequestKey(tokens, rep)))
        return samples
    finally:
        consumer.close()
        producer.close()


class VethLink:
    """Two network namespaces joined by a veth pair, on addresses of the benchmarking range
    (198.18.0.0/15, never routed out), removed on exit. Needs root (CAP_NET_ADMIN)."""

    DEVICE = "pdlink"  # the interface's name in both namespaces
    SUBNET = "198.19.77"

    def __init__(self, cap: str | None = None) -> None:
        tag = f"{os.getpid() % 100000}"
        self.producer, self.consumer = f"pdbench-p{tag}", f"pdbench-c{tag}"
        self.cap = cap

    def __enter__(self) -> "VethLink":
        if os.geteuid() != 0:
            raise PermissionError("the veth-tcp transport makes network namespaces: run as root")
        try:
            for name in (self.producer, self.consumer):
                _ip("netns", "add", name)
            _ip("link", "add", "pdb-p", "netns", self.producer, "type", "veth", "peer", "pdb-c", "netns", self.consumer)
            for ns, device, host in ((self.producer, "pdb-p", 1), (self.consumer, "pdb-c", 2)):
                _ip("-n", ns, "link", "set", device, "name", self.DEVICE)
                _ip("-n", ns, "addr", "add", f"{self.SUBNET}.{host}/30", "dev", self.DEVICE)
                _ip("-n", ns, "link", "set", self.DEVICE, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.cap:  # both directions: the READ's data flows producer -> consumer
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.DEVICE, "root", "tbf",
                         "rate", self.cap, "burst", "256kb", "latency", "50ms")  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name in (self.producer, self.consumer):  # its end of the veth pair goes with it
            with contextlib.suppress(Exception):
                _ip("netns", "del", name)


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*argv: str) -> None:
    import subprocess

    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


def _enter_netns(name: str) -> None:
    """Move this process into network namespace `name`, with a /sys of its own that lists that
    namespace's devices (UCX finds its devices there), as `ip netns exec` does. setns(2) and
    unshare(2) through libc: os.setns is Python 3.12+."""
    import ctypes

    clone_newnet, clone_newns = 0x40000000, 0x00020000
    ms_rec, ms_private = 0x4000, 0x40000
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what} (entering network namespace {name})")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, clone_newnet), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(clone_newns), "unshare")
    check(libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


# ---- results ----------------------------------------------------------------------------


def _single(values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        raise ValueError(f"{what} differs between repetitions: {values}")
    return values[0]


def _row(transport: Transport, tokens: int, samples: list[Sample]) -> Row:
    attention = _single([s.attention_bytes for s in samples], "attention bytes")
    state = _single([s.state_bytes for s in samples], "state bytes")
    transfer_s = statistics.median(s.transfer_s for s in samples)
    copy_s = statistics.median(s.copy_s for s in samples)
    gib = (attention + state) / GiB
    return Row(
        transport=transport.name,
        prompt_tokens=tokens,
        attention_kv_bytes=attention,
        deltanet_state_bytes=state,
        descriptors=_single([s.descriptors for s in samples], "descriptor count"),
        reps=len(samples),
        transfer_ms=transfer_s * 1e3,
        transfer_ms_each=tuple(s.transfer_s * 1e3 for s in samples),
        prep_ms=statistics.median(s.prep_s for s in samples) * 1e3,
        gib_per_s=gib / transfer_s,
        copy_gib_per_s=gib / copy_s,
        ratio=copy_s / transfer_s,
        intact=all(s.intact for s in samples),
    )


def measure(config: BenchConfig) -> Report:
    """Run every transport setting in turn (each its own process pair) and summarise."""
    rows = tuple(
        _row(transport, tokens, samples)
        for transport in config.transports
        for tokens, samples in _run_transport(config, transport).items()
    )
    target = next(
        (r for r in rows if r.transport == TARGET_TRANSPORT and r.prompt_tokens == TARGET_TOKENS),
        None,
    )
    return Report(
        rows=rows,
        target_ratio=target.ratio if target else None,
        target_met=target.ratio >= TARGET_RATIO if target else None,
    )


def _target_line(report: Report) -> str:
    point = f"{TARGET_TOKENS} tokens over {TARGET_TRANSPORT} transports"
    if report.target_ratio is None:
        return f"target (>= {TARGET_RATIO:.0%} of in-process copy at {point}): not measured"
    verdict = "MET" if report.target_met else "NOT MET"
    return (
        f"target >= {TARGET_RATIO:.0%} of in-process copy at {point}: "
        f"{report.target_ratio:.0%} -> {verdict}"
    )


def format_table(config: BenchConfig, report: Report) -> str:
    header = (
        f"{'transport':<12} {'tokens':>6} {'attn MiB':>9} {'state MiB':>9} {'descs':>6} "
        f"{'ms':>8} {'GiB/s':>6} {'copy GiB/s':>10} {'ratio':>6} {'intact':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in report.rows:
        lines.append(
            f"{r.transport:<12} {r.prompt_tokens:>6} {r.attention_kv_bytes / MiB:>9.0f} "
            f"{r.deltanet_state_bytes / MiB:>9.1f} {r.descriptors:>6} {r.transfer_ms:>8.1f} "
            f"{r.gib_per_s:>6.2f} {r.copy_gib_per_s:>10.2f} {r.ratio:>6.2f} {r.intact!s:>6}"
        )
    lines.append(f"copy: in-process gather by index of the same bytes, {config.copy_threads} thread(s)")
    lines.append(_target_line(report))
    return "\n".join(lines)


def write_json(config: BenchConfig, report: Report, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": asdict(config),
        "layout_bytes": {
            "block": config.layout.block_bytes,
            "deltanet_state_per_request": config.layout.state_bytes,
        },
        "cpu_count": os.cpu_count(),
        "rows": [asdict(r) | {"total_bytes": r.total_bytes} for r in report.rows],
        "target": {
            "tokens": TARGET_TOKENS,
            "transport": TARGET_TRANSPORT,
            "ratio_needed": TARGET_RATIO,
            "ratio": report.target_ratio,
            "met": report.target_met,
        },
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")


def _parse_args() -> tuple[BenchConfig, Path]:
    defaults = BenchConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(defaults.lengths))
    parser.add_argument("--reps", type=int, default=defaults.reps)
    parser.add_argument(
        "--transports", nargs="+", choices=sorted(TRANSPORTS), default=[t.name for t in defaults.transports]
    )
    parser.add_argument("--link-cap", help="veth-tcp: cap the link with tc tbf, e.g. 1gbit")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    config = BenchConfig(
        lengths=tuple(args.lengths),
        reps=args.reps,
        transports=tuple(TRANSPORTS[name] for name in args.transports),
        link_cap=args.link_cap,
    )
    return config, args.out


def main() -> None:
    config, out = _parse_args()
    report = measure(config)
    print(format_table(config, report))
    write_json(config, report, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
