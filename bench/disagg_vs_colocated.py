"""Colocated vs disaggregated TTFT and decode rate for the same prompts, side by side.

One run, interleaved: for each prompt length, every repetition runs the colocated engine
and then the prefill->NIXL->decode pair on the same prompt, so machine noise hits both.
Prints medians and the ratios disaggregated / colocated.

    python -m bench.disagg_vs_colocated [--lengths 128 1024 4096] [--reps 5] [--tp 2]

`--tp N` runs every engine tensor-parallel over N ranks (on CPU, N core sets): the
disaggregated pair at TP N -> N against a colocated engine at TP N.
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
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from controller.deployment import Deployment, DeploymentConfig
from cluster.ray_cluster import start_local
from vllm_engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Sample:
    ttft_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Phases:
    """Where a disaggregated request's time goes (medians, ms): routing and the feed hop
    before prefill, the prefill engine (it samples the first token, so TTFT ends about
    here), and the handoff: prefill done -> decode's first token (the NIXL pull and one
    decode step; it lengthens the first inter-token gap)."""

    queue_ms: float
    prefill_ms: float
    transfer_ms: float


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
    disagg_phases: Phases


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


async def _disaggregated(orchestrator, request: GenerateRequest) -> tuple[Sample, GenerationResult]:
    start = time.perf_counter()
    times: list[float] = []
    result: GenerationResult | None = None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
        else:
            times.extend([time.perf_counter()] * len(event.token_ids))
    assert result is not None
    return Sample(times[0] - start, _rate(times)), result


async def run(lengths: list[int], reps: int, max_tokens: int, model: str, tp: int = 1) -> list[Row]:
    engine = EngineConfig(model=model, tensor_parallel_size=tp)
    deployment = Deployment(DeploymentConfig(engine=engine))
    orchestrator = await deployment.start()
    # The colocated engine gets the decode engine's cores (prefill took the first `tp`);
    # only one of them works at a time.
    colocated = DecodeActor.remote("colocated", deployment.config.engine_for("decode", tp), None)
    await colocated.ready.remote()
    rows = []
    try:
        for length in lengths:
            sampling = SamplingConfig(max_tokens=max_tokens, ignore_eos=True)
            # Warm-up for this shape (and, once, the NIXL handshake).
            await _colocated(colocated, GenerateRequest(f"wc-{length}", _prompt(length, 99), sampling))
            await _disaggregated(orchestrator, GenerateRequest(f"wd-{length}", _prompt(length, 99), sampling))
            co, pd, results = [], [], []
            for rep in range(reps):
                prompt = _prompt(length, rep)
                co.append(await _colocated(colocated, GenerateRequest(f"c-{length}-{rep}", prompt, sampling)))
                sample, result = await _disaggregated(
                    orchestrator, GenerateRequest(f"d-{length}-{rep}", prompt, sampling)
                )
                pd.append(sample)
                results.append(result)
            c_ttft = statistics.median(s.ttft_s for s in co)
            d_ttft = statistics.median(s.ttft_s for s in pd)
            c_tps = statistics.median(s.decode_tokens_per_s for s in co)
            d_tps = statistics.median(s.decode_tokens_per_s for s in pd)
            phases = Phases(
                *(
                    statistics.median(getattr(r.timings, phase) for r in results) * 1e3
                    for phase in ("queue_s", "prefill_s", "transfer_s")
                )
            )
            moved = results[-1].timings.transfer_bytes.total
            rows.append(
                Row(length, c_ttft * 1e3, d_ttft * 1e3, c_tps, d_tps, d_ttft / c_ttft, d_tps / c_tps, moved, phases)
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
        f"disagg {r.disagg_decode_tps:6.1f} tok/s  ratio {r.decode_ratio:5.2f}x | moved {r.disagg_bytes:,} B\n"
        f"       disaggregated: routing + feed hop {r.disagg_phases.queue_ms:.1f} ms, prefill engine "
        f"{r.disagg_phases.prefill_ms:.1f} ms, handoff to decode's first token {r.disagg_phases.transfer_ms:.1f} ms",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of every engine")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON (default bench/results/disagg_vs_colocated[_tpN].json)"
    )
    args = parser.parse_args()
    args.out = args.out or Path(f"bench/results/disagg_vs_colocated{f'_tp{args.tp}' if args.tp > 1 else ''}.json")
    start_local()
    print(f"all engines at TP {args.tp}", flush=True)
    rows = asyncio.run(run(args.lengths, args.reps, args.max_tokens, args.model, args.tp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    print("\nratios (disaggregated / colocated; targets: TTFT <= 1.2x at 1024, decode >= 0.95x):")
    for r in rows:
        print(f"  {r.prompt_tokens:>6} tokens: TTFT {r.ttft_ratio:.2f}x, decode tokens/s {r.decode_ratio:.2f}x")


if __name__ == "__main__":
    main()
