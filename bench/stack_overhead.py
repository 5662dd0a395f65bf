"""What the serving stack (gRPC + router + Ray) costs on top of the engines, side by side.

One run, interleaved repetitions of the same single-stream request:
- in-process: the router process calls the orchestrator directly (the core path's handoff);
- gRPC: a client streams the same request through the router's gRPC server.
Prints the token rate through the whole stack against the decode engine's own rate (from
the engine's emit timestamps) and the TTFT added by gRPC + the router server.

    python -m bench.stack_overhead [--prompt-tokens 1024] [--max-tokens 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from router.client import build_request, stream_generate
from controller.deployment import DeploymentConfig
from controller.local_stack import LocalStack
from cluster.ray_cluster import start_local
from vllm_engine.config import EngineConfig, resolve_model


@dataclass(frozen=True, slots=True)
class Report:
    prompt_tokens: int
    output_tokens: int
    engine_decode_tps: float  # decode engine's own emit rate
    grpc_decode_tps: float  # as received by a gRPC client
    inprocess_ttft_ms: float
    grpc_ttft_ms: float
    router_queue_ms: float  # routing + the prefill leg's start and answer (in-process path)

    @property
    def rate_ratio(self) -> float:
        return self.grpc_decode_tps / self.engine_decode_tps

    @property
    def added_ttft_ms(self) -> float:
        return self.grpc_ttft_ms - self.inprocess_ttft_ms


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0])


async def _inprocess(orchestrator, request: GenerateRequest) -> tuple[float, float, float]:
    start = time.perf_counter()
    first = None
    emitted: list[float] = []
    result: GenerationResult | None = None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
            continue
        first = first or time.perf_counter()
        emitted.extend([event.produced_at] * len(event.token_ids))
    assert result is not None and first is not None
    return first - start, _rate(emitted), result.timings.queue_s


async def _through_grpc(channel, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, float]:
    request = build_request(prompt, request_id, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    received: list[float] = []
    async for response in stream_generate(channel, request):
        if response.HasField("chunk"):
            received.extend([time.perf_counter()] * len(response.chunk.token_ids))
    return received[0] - start, _rate(received)


async def run(prompt_tokens: int, max_tokens: int, reps: int, model: str) -> Report:
    config = DeploymentConfig(engine=EngineConfig(model=resolve_model(model)))
    stack = await LocalStack(config, text_prompts=False).start()
    orchestrator = stack.orchestrator
    prompt = [(31 * i + 7) % 2000 + 1 for i in range(prompt_tokens)]
    sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
    samples: dict[str, list[float]] = {k: [] for k in ("ttft_in", "tps_engine", "queue", "ttft_grpc", "tps_grpc")}
    try:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            for rep in range(-1, reps):  # rep -1 warms up both paths (and the NIXL handshake)
                ttft_in, tps_engine, queue = await _inprocess(
                    orchestrator, GenerateRequest(f"in-{rep}", tuple(prompt), sampling)
                )
                ttft_grpc, tps_grpc = await _through_grpc(channel, prompt, max_tokens, f"grpc-{rep}")
                if rep >= 0:
                    for key, value in zip(samples, (ttft_in, tps_engine, queue, ttft_grpc, tps_grpc)):
                        samples[key].append(value)
    finally:
        await stack.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return Report(
        prompt_tokens,
        max_tokens,
        engine_decode_tps=med["tps_engine"],
        grpc_decode_tps=med["tps_grpc"],
        inprocess_ttft_ms=med["ttft_in"] * 1e3,
        grpc_ttft_ms=med["ttft_grpc"] * 1e3,
        router_queue_ms=med["queue"] * 1e3,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("bench/results/stack_overhead.json"))
    args = parser.parse_args()
    start_local()
    report = asyncio.run(run(args.prompt_tokens, args.max_tokens, args.reps, args.model))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({**asdict(report), "rate_ratio": report.rate_ratio, "added_ttft_ms": report.added_ttft_ms}, indent=2)
    )
    print(f"prompt {report.prompt_tokens} tokens, {report.output_tokens} output tokens, median of {args.reps}")
    print(
        f"decode rate: engine {report.engine_decode_tps:.1f} tok/s, through gRPC+router+Ray "
        f"{report.grpc_decode_tps:.1f} tok/s -> ratio {report.rate_ratio:.3f} (target >= 0.9)"
    )
    print(
        f"TTFT: in-process orchestrator {report.inprocess_ttft_ms:.1f} ms, through gRPC "
        f"{report.grpc_ttft_ms:.1f} ms -> gRPC + router server add {report.added_ttft_ms:.1f} ms; "
        f"routing + the prefill leg's start and answer {report.router_queue_ms:.1f} ms (target: total added <= 10 ms)"
    )


if __name__ == "__main__":
    main()
