"""`pdserve` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

DEFAULT_PROMPT = (
    "Prefill processes the prompt and creates state; decode consumes that state one token "
    "at a time. They are effectively two different machines."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="local cluster: one prefill and one decode engine, stream one generation, print phase timings",
    )
    demo.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    demo.add_argument("--model", default="embedded", help="HF model directory (default: embedded tiny Qwen3.5 hybrid)")
    demo.add_argument("--max-tokens", type=int, default=48)

    args = parser.parse_args(argv)
    if args.command == "demo":
        return asyncio.run(_demo(args))
    return 2


async def _demo(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from router.deployment import Deployment, DeploymentConfig
    from router.orchestrator import GenerationResult
    from router.ray_cluster import start_local
    from vllm_engine.config import EngineConfig, resolve_model
    from vllm_engine.requests import GenerateRequest, SamplingConfig

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    print(f"model: {model}", file=sys.stderr)
    start_local()
    deployment = Deployment(DeploymentConfig(engine=EngineConfig(model=model)))
    try:
        print("starting one prefill and one decode engine (Ray actors)...", file=sys.stderr)
        orchestrator = await deployment.start()
        # Warm-up: the first request pays the one-time NIXL handshake between the pair.
        async for _ in orchestrator.generate(
            GenerateRequest("warmup", tuple(tokenizer.encode("warm up")), SamplingConfig(max_tokens=2))
        ):
            pass
        request = GenerateRequest(
            f"demo-{uuid.uuid4().hex[:8]}",
            tuple(tokenizer.encode(args.prompt)),
            SamplingConfig(max_tokens=args.max_tokens, ignore_eos=True),
        )
        print(f"\n{args.prompt}", end="", flush=True)
        result: GenerationResult | None = None
        async for event in orchestrator.generate(request):
            if isinstance(event, GenerationResult):
                result = event
            else:
                print(event.text, end="", flush=True)
        print("\n")
        assert result is not None
        _print_result(result)
    finally:
        deployment.shutdown()
    return 0


def _print_result(result) -> None:  # noqa: ANN001
    t = result.timings
    b = t.transfer_bytes
    rows = [
        ("prompt / completion tokens", f"{result.prompt_tokens} / {result.completion_tokens} ({result.finish_reason})"),
        ("queue (routing + Ray hop)", f"{t.queue_s * 1e3:.1f} ms"),
        ("prefill", f"{t.prefill_s * 1e3:.1f} ms on {result.prefill_worker}"),
        ("handoff (NIXL pull + first step)", f"{t.handoff_s * 1e3:.1f} ms on {result.decode_worker}"),
        ("time to first token", f"{t.ttft_s * 1e3:.1f} ms"),
        ("decode", f"{t.decode_tokens_per_s:.1f} tok/s, inter-token p50 {t.inter_token.p50_s * 1e3:.1f} ms, p99 {t.inter_token.p99_s * 1e3:.1f} ms"),
        ("bytes moved", f"{b.total:,} = attention KV {b.attention_kv:,} + DeltaNet state {b.deltanet_state:,}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
