"""GPU smoke test: one prefill and one decode engine sharing this machine's one CUDA GPU.

    PDSERVE_DEVICE=gpu make install
    .venv/bin/python -m deploy.gpu_smoke [PROMPT] [--max-tokens N] [engine flags of `pdserve demo`]

Starts a private local Ray cluster, a TP-1 prefill and a TP-1 decode engine on the embedded
model with `--device cuda` (weights, KV cache and NIXL's KV buffers in GPU memory), streams
one generation through the gRPC router, and prints the bytes decode pulled from prefill
(attention KV + DeltaNet state), time to first token and decode rate. Exits 1 if there is
no CUDA GPU (checked before anything starts), if a generation fails, or if no KV crossed
from prefill to decode.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import TYPE_CHECKING

from cli.config import DEFAULT_PROMPT, DEMO_FIXED, DemoConfig
from cli.main import _print_final
from configuration.flags import add_flags, build, set_flag_defaults

if TYPE_CHECKING:
    from proto.pdserve.v1.generate_pb2 import Final

# Both engines on one GPU: Ray hands each half of it (both see the same device), and each
# vLLM engine may use 40% of its memory, leaving room for the two CUDA contexts.
GPUS_PER_RANK = 0.5
GPU_MEMORY_UTILIZATION = 0.4
# A prompt unlike the measured one: no prefix-cache hit makes the measured transfer smaller.
WARM_UP_PROMPT = "Warm-up request: the first generation pays one-time kernel and transfer set-up costs."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.gpu_smoke",
        description=__doc__.split("\n")[0],
        epilog=f"Defaults here, unlike `pdserve demo`: --device cuda, --gpu-memory-utilization "
        f"{GPU_MEMORY_UTILIZATION} (the two engines share the GPU, so keep TP 1 and their utilizations' sum below 1).",
    )
    parser.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds for both engines to start")
    add_flags(parser, DemoConfig, DEMO_FIXED)
    set_flag_defaults(
        parser,
        DemoConfig,
        {"device": "cuda", "gpu-memory-utilization": GPU_MEMORY_UTILIZATION, "gpus-per-rank": GPUS_PER_RANK},
    )
    args = parser.parse_args(argv)
    prompt, start_timeout_s = args.prompt, args.start_timeout
    del args.prompt, args.start_timeout
    try:
        demo = build(DemoConfig, args)
    except ValueError as err:
        parser.error(str(err))
    if demo.deployment.engine.device != "cuda":
        parser.error("this smoke test is for CUDA (`pdserve demo` runs the same path on CPU): leave --device cuda")

    import torch

    if not torch.cuda.is_available():
        kind = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu_smoke: no CUDA GPU: torch {torch.__version__} ({kind}) sees no device. Run it on a machine "
            "with an NVIDIA GPU and driver, after `PDSERVE_DEVICE=gpu make install`.",
            file=sys.stderr,
        )
        return 1
    try:
        return asyncio.run(_smoke(demo, prompt, start_timeout_s))
    except ValueError as err:  # a configuration the engines cannot run
        print(f"gpu_smoke: {err}", file=sys.stderr)
        return 2


async def _smoke(demo: DemoConfig, prompt: str, start_timeout_s: float) -> int:
    import ray

    from cluster import ray_cluster
    from controller.local_stack import LocalStack

    if demo.address:
        ray_cluster.join(demo.address)
        logs = "the cluster's Ray logs"
    else:
        logs = f"{ray_cluster.start_local()}/session_latest/logs"
    stack = LocalStack(demo.deployment, verbose=True)
    try:
        if not ray.cluster_resources().get("GPU"):
            print("gpu_smoke: Ray found no GPU on this node (is CUDA_VISIBLE_DEVICES empty?)", file=sys.stderr)
            return 1
        try:
            await asyncio.wait_for(stack.start(), start_timeout_s)
        except asyncio.TimeoutError:
            print(f"gpu_smoke: the engines did not start in {start_timeout_s:.0f} s; see {logs}", file=sys.stderr)
            return 1
        if await _stream(stack.address, WARM_UP_PROMPT, max_tokens=2, quiet=True) is None:
            return 1
        print(f"\n{prompt}", end="", flush=True)
        final = await _stream(stack.address, prompt, max_tokens=demo.max_tokens)
        if final is None:
            return 1
        print("\n")
        _print_final(final)
        if not final.timings.attention_kv_bytes:
            print(
                f"gpu_smoke: decode pulled no KV from prefill (the prompt was prefilled on decode?); see {logs}",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        await stack.stop()
        ray.shutdown()


async def _stream(target: str, prompt: str, max_tokens: int, quiet: bool = False) -> "Final | None":
    """One generation through gRPC; its final message, or None after printing the error."""
    import grpc

    from router.client import build_request, stream_generate

    request = build_request(prompt, f"gpu-smoke-{uuid.uuid4().hex[:8]}", max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            async for response in stream_generate(channel, request, timeout_s=300):
                if response.HasField("chunk"):
                    if not quiet:
                        print(response.chunk.text, end="", flush=True)
                else:
                    return response.final
        except grpc.aio.AioRpcError as err:
            print(f"\ngpu_smoke: generation failed: {err.code().name}: {err.details()}", file=sys.stderr)
    return None


if __name__ == "__main__":
    sys.exit(main())
