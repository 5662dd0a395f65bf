"""Cluster probe: measure prefill and decode apart on this hardware (the seeds' measurement).

Prefill tokens/s from single-pass prefills at growing prompt lengths and batch sizes, on the
engine itself; decode tokens/s at batch 1 and growing batches until throughput stops scaling
(the batch where decode turns compute-bound), from streams timed where gRPC clients receive
them; transfer time against bytes and the serving path's own share of time to first token,
from requests sent through gRPC to a real prefill -> NIXL -> decode pair. Prints the
prefill/decode throughput ratio and the knee, and writes the probe JSON the ratio tuner fits
its performance model to.

    pdserve probe [--out bench/results/probe.json]     (or python -m cli.probe)
    pdserve probe --address HEAD:6379 --device cuda --prefill-tp 4 --decode-tp 4

On a cluster (`--address`) the engines are placed like `pdserve serve` places them, by the
pools' Ray resources: the handoff pair on the cluster's own prefill and decode nodes; the
colocated engines that measure prefill (at the prefill TP) and decode (at the decode TP)
apart on decode-pool nodes. The JSON records device and TP sizes: `pdserve tune` plans in
engines of those sizes and `--apply` refuses a live deployment of other sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import psutil
import ray

from configuration.fields import default_of, knob
from configuration.flags import add_flags, build
from messages.requests import GenerateRequest, SamplingConfig
from proto.pdserve.v1 import generate_pb2 as pb
from router.client import build_request, stream_generate
from controller.deployment import Deployment, DeploymentConfig, check_tp_pairing
from controller.local_stack import LocalStack
from cluster.ray_cluster import join, start_local
from vllm_engine.config import Device, EngineConfig, EngineSizing, resolve_model

# Decode throughput that grows by less than this from one batch size to the next has
# stopped scaling: the engine is compute-bound there.
SCALING_THRESHOLD = 1.15
STEADY_AFTER = 8  # a decode stream's first tokens are not timed: the batch's prefills land there


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    address: str | None = knob(None, help="probe this Ray cluster's nodes instead of a local cluster")
    model: str = knob(default_of(EngineConfig, "model"), help="model directory, or 'embedded'")
    device: Device = knob(default_of(EngineConfig, "device"), help="where the engines run")
    prefill_tp: int = knob(default_of(EngineConfig, "tensor_parallel_size"), help="TP size of the prefill engines")
    decode_tp: int = knob(default_of(EngineConfig, "tensor_parallel_size"), help="TP size of the decode engines")
    prompt_lengths: tuple[int, ...] = knob((128, 512, 1024, 2048, 4096), help="prefill: prompt lengths to time")
    prefill_batches: tuple[int, ...] = knob((1, 4), help="prefill: prompts per pass")
    decode_batches: tuple[int, ...] = knob((1, 2, 4, 8, 16, 32, 64, 128), help="decode: batch sizes (past the knee)")
    decode_context: int = knob(256, help="decode: prompt tokens per stream")
    decode_steps: int = knob(48, help=f"decode: tokens per stream (the first {STEADY_AFTER} are not timed)")
    transfer_lengths: tuple[int, ...] = knob((256, 1024, 4096), help="handoff: prompt lengths sent prefill -> decode")
    transfer_repeats: int = knob(2, help="handoff: passes over those lengths")
    out: str = knob("bench/results/probe.json", help="where the probe JSON goes")

    def __post_init__(self) -> None:
        for name in ("prompt_lengths", "prefill_batches", "decode_batches", "transfer_lengths"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be one or more values >= 1, got {values}")
        for name in ("prefill_tp", "decode_tp", "decode_context", "transfer_repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_steps < STEADY_AFTER + 2:  # at least one timed gap
            raise ValueError(f"decode_steps must be >= {STEADY_AFTER + 2}, got {self.decode_steps}")
        check_tp_pairing(self.prefill_tp, self.decode_tp)


@dataclass(slots=True)
class ProbeResult:
    hardware: str
    model: str
    prefill: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    transfer: list[dict] = field(default_factory=list)
    layout: dict = field(default_factory=dict)
    # Isolated requests through gRPC: client TTFT, and the part spent in the engines (prefill
    # plus handoff); the difference is the serving path's own cost.
    serving: list[dict] = field(default_factory=list)
    # CPU engines only: busy cores outside the engines against tokens streamed per second.
    host_cpu: dict | None = None
    # What was measured: {"device", "prefill_tp", "decode_tp"} (engines of these sizes).
    engines: dict = field(default_factory=dict)

    def prefill_tokens_per_s(self) -> float:
        return max(p["batch_tokens"] / p["seconds"] for p in self.prefill)

    def decode_tokens_per_s(self, batch_size: int = 1) -> float:
        return max(d["batch_size"] / d["step_seconds"] for d in self.decode if d["batch_size"] == batch_size)

    def decode_knee(self) -> int:
        """Largest batch before decode throughput stops growing by SCALING_THRESHOLD."""
        rates = [(d["batch_size"], d["batch_size"] / d["step_seconds"]) for d in self.decode]
        for (batch, rate), (_, next_rate) in zip(rates, rates[1:]):
            if next_rate < rate * SCALING_THRESHOLD:
                return batch
        return rates[-1][0]


def _prompt(length: int, salt: int) -> tuple[int, ...]:
    return tuple((37 * i + 11 * salt + 1) % 2000 + 1 for i in range(length))


async def _ttft(actor, request: GenerateRequest) -> float:
    start = time.perf_counter()
    async for ref in actor.generate.remote(request):
        await ref
        return time.perf_counter() - start
    raise RuntimeError("no output")


async def _token_arrivals(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> list[float]:
    times: list[float] = []
    async for response in stream_generate(channel, request):
        if response.HasField("chunk"):
            times.extend([time.perf_counter()] * len(response.chunk.token_ids))
    return times


async def probe_prefill(actor, config: ProbeConfig, result: ProbeResult) -> None:
    one_token = SamplingConfig(max_tokens=1, ignore_eos=True)
    await _ttft(actor, GenerateRequest("warm", _prompt(64, 0), one_token))
    for length in config.prompt_lengths:
        for batch in config.prefill_batches:
            requests = [GenerateRequest(f"p-{length}-{batch}-{i}", _prompt(length, i), one_token) for i in range(batch)]
            seconds = max(await asyncio.gather(*(_ttft(actor, r) for r in requests)))
            result.prefill.append({"prompt_tokens": length, "batch_tokens": length * batch, "seconds": seconds})


def _busy_cpu_s(engine_pids: list[int]) -> float:
    """CPU seconds the whole host has been busy, less what the engine processes used."""
    host = psutil.cpu_times()
    busy = host.user + host.nice + host.system + getattr(host, "irq", 0.0) + getattr(host, "softirq", 0.0)
    engines = sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in engine_pids)
    return busy - engines


async def probe_decode(
    channel: grpc.aio.Channel, engine_pids: list[int], config: ProbeConfig, result: ProbeResult
) -> None:
    """Batches of streams through gRPC, timed where clients see the tokens. Also how many
    cores the rest of the host (router, gRPC, Ray, this client) keeps busy meanwhile: on CPU
    serving that is time the engines' cores lose."""
    for batch in config.decode_batches:
        prompts = [list(_prompt(config.decode_context, i)) for i in range(batch)]
        requests = [
            build_request(p, f"d-{batch}-{i}", max_tokens=config.decode_steps, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        started, busy_before = time.perf_counter(), _busy_cpu_s(engine_pids)
        streams = await asyncio.gather(*(_token_arrivals(channel, r) for r in requests))
        wall = time.perf_counter() - started
        if result.host_cpu is not None:
            result.host_cpu["rows"].append(
                {
                    "tokens_per_s": sum(len(times) for times in streams) / wall,
                    "busy_cores": max(1e-6, (_busy_cpu_s(engine_pids) - busy_before) / wall),
                }
            )
        # Steady state: skip the first tokens, where prefills of the batch land. A stream's
        # mean gap, not each gap: chunks may carry several tokens when the client lags.
        step = statistics.median(
            (times[-1] - times[STEADY_AFTER]) / (len(times) - STEADY_AFTER - 1) for times in streams
        )
        result.decode.append(
            {
                "batch_size": batch,
                "context_tokens": config.decode_context + config.decode_steps // 2,
                "step_seconds": step,
            }
        )
        if len(result.decode) >= 2 and result.decode_knee() < batch:
            return  # throughput stopped scaling: past the knee


async def _timed_generation(channel: grpc.aio.Channel, request: pb.GenerateRequest) -> tuple[float, pb.Timings]:
    """Client-side time to first token, and the router's phase timings of the request."""
    sent = time.perf_counter()
    first = None
    async for response in stream_generate(channel, request):
        if first is None:
            first = time.perf_counter() - sent
        if response.HasField("final"):
            return first, response.final.timings
    raise RuntimeError("stream ended without a final message")


@contextlib.asynccontextmanager
async def _served(config: DeploymentConfig) -> AsyncIterator[tuple[Deployment, grpc.aio.Channel]]:
    """A deployment behind a gRPC router server, and a client channel to it."""
    async with LocalStack(config, text_prompts=False) as stack:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            yield stack.deployment, channel


async def probe_transfer(channel: grpc.aio.Channel, config: ProbeConfig, result: ProbeResult) -> None:
    """Handoffs through the whole serving path, as clients use it (gRPC -> router -> prefill
    actor -> NIXL -> decode actor): transfer time against bytes, and what the path adds to
    time to first token beyond the engines' work (gRPC, routing, the feeds)."""
    step = result.decode[0]["step_seconds"] if result.decode else 0.0
    for repeat in range(config.transfer_repeats):
        for length in config.transfer_lengths:
            # Two tokens: where prefill samples the first, only the second needs decode.
            request = build_request(
                list(_prompt(length, 7 + repeat)), f"t-{length}-{repeat}", max_tokens=2, ignore_eos=True
            )
            client_ttft, t = await _timed_generation(channel, request)
            # The handoff includes decode's first step; what remains is the pull.
            num_bytes = t.attention_kv_bytes + t.deltanet_state_bytes
            result.transfer.append({"bytes": num_bytes, "seconds": max(1e-6, t.transfer_s - step)})
            # The engines' share of TTFT: prefill, plus the handoff where decode made the first
            # token; the router's own time before prefill (queue_s) is the path's.
            engine_s = t.ttft_s - t.queue_s
            result.serving.append({"prompt_tokens": length, "client_ttft_s": client_ttft, "engine_s": engine_s})


async def run_probe(config: ProbeConfig) -> ProbeResult:
    import platform

    engine = EngineConfig(model=resolve_model(config.model), device=config.device)
    result = ProbeResult(
        hardware=f"{platform.machine()} {platform.processor() or 'cpu'}",
        model=engine.model,
        engines={"device": config.device, "prefill_tp": config.prefill_tp, "decode_tp": config.decode_tp},
    )
    # Colocated engines, with batches large enough to find the knee, placed as deployed:
    # prefill measured at the prefill TP, decode at the decode TP (one engine when equal).
    stages: dict[int, list[str]] = {}
    stages.setdefault(config.prefill_tp, []).append("prefill")
    stages.setdefault(config.decode_tp, []).append("decode")
    for tp, measures in stages.items():
        sizing = EngineSizing(tensor_parallel_size=tp, max_num_seqs=max(config.decode_batches))
        colocated = DeploymentConfig(engine=engine, num_prefill=0, decode_sizing=sizing)
        async with _served(colocated) as (deployment, channel):
            actor = deployment.decode.members[0].actor
            if "prefill" in measures:
                await probe_prefill(actor, config, result)
            if "decode" in measures:
                if colocated.cpu_cores and engine.device == "cpu":  # engines share the host's cores
                    result.host_cpu = {"engine_cores": len(colocated.cpu_cores), "rows": []}
                await probe_decode(channel, [await actor.pid.remote()], config, result)
    pair = DeploymentConfig(
        engine=engine,
        prefill_sizing=EngineSizing(tensor_parallel_size=config.prefill_tp),
        decode_sizing=EngineSizing(tensor_parallel_size=config.decode_tp),
    )
    async with _served(pair) as (deployment, channel):
        layout = await deployment.prefill.members[0].actor.state_layout.remote()
        result.layout = {
            "attention_kv_bytes_per_token": layout.attention_kv_bytes_per_token,
            "deltanet_state_bytes_per_request": layout.deltanet_state_bytes_per_request,
        }
        await probe_transfer(channel, config, result)
    return result


def report(result: ProbeResult) -> str:
    prefill = result.prefill_tokens_per_s()
    decode = result.decode_tokens_per_s(1)
    e = result.engines
    lines = [
        f"engines: {e.get('device', 'cpu')}, prefill TP {e.get('prefill_tp', 1)}, decode TP {e.get('decode_tp', 1)}",
        f"prefill: {prefill:,.0f} prompt tokens/s (best pass)",
        f"decode:  {decode:,.1f} tokens/s at batch 1; by batch: "
        + ", ".join(f"{d['batch_size']}: {d['batch_size'] / d['step_seconds']:,.0f}" for d in result.decode),
        f"prefill/decode throughput ratio at batch 1: {prefill / decode:,.1f}x",
        f"decode turns compute-bound past batch ~{result.decode_knee()}",
    ]
    if result.transfer:
        lines.append(
            "transfer: " + ", ".join(f"{t['bytes']:,} B in {t['seconds'] * 1e3:.1f} ms" for t in result.transfer)
        )
    if result.host_cpu:
        rows = result.host_cpu["rows"]
        lines.append(
            "outside the engines the host kept busy: "
            + ", ".join(f"{r['busy_cores']:.2f} cores at {r['tokens_per_s']:,.0f} tok/s" for r in rows)
        )
    if result.serving:
        overheads = [s["client_ttft_s"] - s["engine_s"] for s in result.serving]
        lines.append(f"serving path (gRPC, router, feeds) adds {statistics.median(overheads) * 1e3:.1f} ms to TTFT")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, ProbeConfig)
    try:
        config = build(ProbeConfig, parser.parse_args(argv))
    except ValueError as err:
        parser.error(str(err))
    if config.address:
        join(config.address)
    elif not ray.is_initialized():
        start_local()
    result = asyncio.run(run_probe(config))
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(result), indent=2))
    print(report(result))
    print(f"probe written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
