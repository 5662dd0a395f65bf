"""The OpenAI HTTP front against the gRPC front: same deployment, same prompts, one run.

One 1 prefill + 1 decode deployment serves both fronts from one router process; the client
runs in a process of its own, as a user's would (a client on the router's event loop slows
whichever front it reads). Requests alternate between the fronts (gRPC, then HTTP with the
same token-id prompt), one at a time, so machine noise hits both alike. Reports client-side
TTFT and streamed tokens/s medians and the ratios HTTP / gRPC (targets: TTFT added <= 2 ms,
stream rate >= 0.97), and the rate at the router, where both fronts take the tokens.

    python -m bench.http_vs_grpc [--reps 15] [--prompt-tokens 1024] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import grpc
import httpx

from router.client import build_request, stream_generate
from controller.deployment import DeploymentConfig
from controller.local_stack import LocalStack
from cluster.ray_cluster import start_local
from vllm_engine.config import EngineConfig, resolve_model

MODEL = "bench"


def _prompt(length: int, rep: int) -> list[int]:
    return [(29 * i + 13 * rep + 5) % 2000 + 1 for i in range(length)]


def _rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


async def _grpc(channel: grpc.aio.Channel, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    started, times, router_rate = time.perf_counter(), [], 0.0
    async for response in stream_generate(channel, build_request(prompt, max_tokens=max_tokens, ignore_eos=True)):
        if response.HasField("chunk"):
            times.extend([time.perf_counter()] * len(response.chunk.token_ids))
        else:
            router_rate = response.final.timings.decode_tokens_per_s
    return times[0] - started, _rate(times), router_rate


async def _http(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started, times, router_rate = time.perf_counter(), [], 0.0
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                    # One event per engine step's tokens; its text may be "" (a token that
                    # ends mid-character), so count events, not text.
                    times.append(time.perf_counter())
                if "pdserve_timings" in chunk:
                    router_rate = chunk["pdserve_timings"]["decode_tokens_per_s"]
    return times[0] - started, _rate(times), router_rate


async def run(model: str, reps: int, prompt_tokens: int, max_tokens: int) -> dict[str, float]:
    config = DeploymentConfig(engine=EngineConfig(model=model))
    stack = LocalStack(config, http="127.0.0.1:0", served_model_name=MODEL, text_prompts=False)
    await stack.start()
    url = f"http://{stack.http.address}/v1/completions"
    command = [sys.executable, "-m", "bench.http_vs_grpc", "--client", stack.address, url,
               "--reps", str(reps), "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens)]
    try:
        client = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
        output, _ = await client.communicate()
        rows = json.loads(output)
    finally:
        await stack.stop()
    ttft = {k: statistics.median(r[0] for r in v) for k, v in rows.items()}
    rate = {k: statistics.median(r[1] for r in v) for k, v in rows.items()}
    # The same, timed where the router hands tokens to each front (no client parsing).
    router_rate = {k: statistics.median(r[2] for r in v) for k, v in rows.items()}
    # Paired differences: each HTTP request against the gRPC request just before it.
    added = statistics.median(h[0] - g[0] for g, h in zip(rows["grpc"], rows["http"]))
    return {
        "ttft_grpc_ms": ttft["grpc"] * 1e3,
        "ttft_http_ms": ttft["http"] * 1e3,
        "ttft_added_ms_median_paired": added * 1e3,
        "rate_grpc_tok_s": rate["grpc"],
        "rate_http_tok_s": rate["http"],
        "rate_ratio": rate["http"] / rate["grpc"],
        "router_rate_grpc_tok_s": router_rate["grpc"],
        "router_rate_http_tok_s": router_rate["http"],
    }


async def client_rows(grpc_target: str, url: str, reps: int, prompt_tokens: int, max_tokens: int) -> dict:
    rows: dict[str, list[tuple[float, float, float]]] = {"grpc": [], "http": []}
    async with grpc.aio.insecure_channel(grpc_target) as channel, httpx.AsyncClient(timeout=120) as client:
        for rep in range(-2, reps):  # two warm-up rounds
            prompt = _prompt(prompt_tokens, rep)
            g = await _grpc(channel, prompt, max_tokens)
            h = await _http(client, url, prompt, max_tokens)
            if rep >= 0:
                rows["grpc"].append(g)
                rows["http"].append(h)
                print(f"rep {rep:>2}: TTFT gRPC {g[0] * 1e3:6.1f} ms  HTTP {h[0] * 1e3:6.1f} ms | "
                      f"{g[1]:6.1f} vs {h[1]:6.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", nargs=2, metavar=("GRPC_TARGET", "HTTP_URL"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("bench/results/http_vs_grpc.json"))
    args = parser.parse_args(argv)
    if args.client:  # the client process: rows as JSON on stdout
        print(json.dumps(asyncio.run(client_rows(*args.client, args.reps, args.prompt_tokens, args.max_tokens))))
        return 0
    start_local()
    result = asyncio.run(run(resolve_model(args.model), args.reps, args.prompt_tokens, args.max_tokens))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"\nTTFT median: gRPC {result['ttft_grpc_ms']:.1f} ms, HTTP {result['ttft_http_ms']:.1f} ms; "
        f"HTTP adds {result['ttft_added_ms_median_paired']:.1f} ms (paired median; target <= 2 ms)\n"
        f"stream rate median: gRPC {result['rate_grpc_tok_s']:.1f}, HTTP {result['rate_http_tok_s']:.1f} tok/s: "
        f"{result['rate_ratio']:.3f}x (target >= 0.97)\n"
        f"at the router (before each front's client): gRPC {result['router_rate_grpc_tok_s']:.1f}, "
        f"HTTP {result['router_rate_http_tok_s']:.1f} tok/s\nresults: {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
