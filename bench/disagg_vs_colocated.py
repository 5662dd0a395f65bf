"""Colocated vs disaggregated TTFT and decode rate for the same prompts, side by side.

One run, interleaved: for each prompt length, every repetition runs the colocated engine
and then the prefill->NIXL->decode pair on the same prompt, so machine noise hits both.
Prints medians and the ratios disaggregated / colocated.

    python -m bench.disagg_vs_colocated [--lengths 128 1024 4096] [--reps 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import ray

from decode_worker.actor import DecodeActor
from router.deployment import Deployment, DeploymentConfig
from router.orchestrator import GenerationResult
from router.ray_cluster import start_local
from vllm_engine.config import EngineConfig
from vllm_engine.requests import GenerateRequest, SamplingConfig


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Row:
    prompt_tokens: int
    colocated_ttft_ms: float
    disagg_ttft_ms: float
    colocated_decode_tps: float
    disagg_decode_tps: float
    ttft_ratio: float
    decode_ratio: float
    disagg_bytes: int


def _prompt(length: int, rep: int) -> tuple[int, ...]:
    return tuple((31 * i + 7 * rep + 3) % 2000 + 1 for i in range(length))


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


async def _colocated(actor, request: GenerateRequest) -> Sample:
    start = time.perf_counter()
    times: list[float] = []
    async for ref in actor.generate.remote(request):
        chunk = await ref
        times.extend([time.perf_counter()] * len(chunk.token_ids))
    return Sample(times[0] - start, _rate(times))


async def _disaggregated(orchestrator, request: GenerateRequest) -> tuple[Sample, int]:
    start = time.perf_counter()
    times: list[float] = []
    result: GenerationResult | None = None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
        else:
            times.extend([time.perf_counter()] * len(event.token_ids))
    assert result is not None
    return Sample(times[0] - start, _rate(times)), result.timings.transfer_bytes.total


async def run(lengths: list[int], reps: int, max_tokens: int, model: str) -> list[Row]:
    engine = EngineConfig(model=model)
    deployment = Deployment(DeploymentConfig(engine=engine))
    orchestrator = await deployment.start()
    # The colocated engine gets the decode engine's core; only one of them works at a time.
    colocated = DecodeActor.remote("colocated", deployment.config.engine_for("decode", 1), None)
    await colocated.ready.remote()
    rows = []
    try:
        for length in lengths:
            sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
            # Warm-up for this shape (and, once, the NIXL handshake).
            await _colocated(colocated, GenerateRequest(f"wc-{length}", _prompt(length, 99), sampling))
            await _disaggregated(orchestrator, GenerateRequest(f"wd-{length}", _prompt(length, 99), sampling))
            co, pd, moved = [], [], 0
            for rep in range(reps):
                prompt = _prompt(length, rep)
                co.append(await _colocated(colocated, GenerateRequest(f"c-{length}-{rep}", prompt, sampling)))
                sample, moved = await _disaggregated(orchestrator, GenerateRequest(f"d-{length}-{rep}", prompt, sampling))
                pd.append(sample)
            c_ttft = statistics.median(s.ttft_s for s in co)
            d_ttft = statistics.median(s.ttft_s for s in pd)
            c_tps = statistics.median(s.decode_tokens_per_s for s in co)
            d_tps = statistics.median(s.decode_tokens_per_s for s in pd)
            rows.append(
                Row(length, c_ttft * 1e3, d_ttft * 1e3, c_tps, d_tps, d_ttft / c_ttft, d_tps / c_tps, moved)
            )
            _print_row(rows[-1])
    finally:
        ray.kill(colocated, no_restart=True)
        deployment.shutdown()
    return rows


def _print_row(r: Row) -> None:
    print(
        f"{r.prompt_tokens:>6} | TTFT colocated {r.colocated_ttft_ms:8.1f} ms  disagg {r.disagg_ttft_ms:8.1f} ms  "
        f"ratio {r.ttft_ratio:5.2f}x | decode colocated {r.colocated_decode_tps:6.1f} tok/s  "
        f"disagg {r.disagg_decode_tps:6.1f} tok/s  ratio {r.decode_ratio:5.2f}x | moved {r.disagg_bytes:,} B",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("bench/results/disagg_vs_colocated.json"))
    args = parser.parse_args()
    start_local()
    rows = asyncio.run(run(args.lengths, args.reps, args.max_tokens, args.model))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print("\nratios (disaggregated / colocated; targets: TTFT <= 1.2x at 1024, decode >= 0.95x):")
    for r in rows:
        print(f"  {r.prompt_tokens:>6} tokens: TTFT {r.ttft_ratio:.2f}x, decode tokens/s {r.decode_ratio:.2f}x")


if __name__ == "__main__":
    main()
