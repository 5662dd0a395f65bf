"""`pdserve plan`: size the prefill and decode engines from a model's config.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from configuration.parsers import parse_bytes
from vllm_engine.config import CPU_DEFAULT_KV_CACHE_BYTES, EMBEDDED_MODEL, EngineConfig, resolve_model
from vllm_engine.sizing import GiB, MiB, ModelShape, SizingError, SizingInputs, plan_engine, render_plan

def main(argv: list[str] | None = None) -> int:
    defaults = EngineConfig()
    parser = argparse.ArgumentParser(
        prog="pdserve plan",
        description="Weights, KV cache, DeltaNet state, blocks and concurrency per engine, from config.json alone.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=EMBEDDED_MODEL, help="model directory with config.json (default: embedded)")
    source.add_argument("--config", default=None, help="a config.json file instead of a model directory")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--prefill-tp", type=int, default=1, help="tensor parallel size of a prefill engine")
    parser.add_argument("--decode-tp", type=int, default=1, help="tensor parallel size of a decode engine")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes,
        default=None,
        help=f"KV cache per rank, e.g. 4GiB (default: {CPU_DEFAULT_KV_CACHE_BYTES // MiB} MiB on cpu, "
        "from GPU memory on cuda, as pdserve's engines)",
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default: 80, an H100)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="prompt length for bytes moved per request")
    parser.add_argument("--context", type=int, default=None, help="tokens per request, for concurrency")
    args = parser.parse_args(argv)

    kv_cache_bytes = args.kv_cache_bytes
    if kv_cache_bytes is None:
        kv_cache_bytes = EngineConfig(device=args.device).kv_cache_memory_bytes
    try:
        shape = _load_shape(args)
        plans = {
            role: plan_engine(
                shape,
                SizingInputs(
                    device=args.device,
                    tensor_parallel_size=tp,
                    max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs,
                    kv_cache_bytes=kv_cache_bytes,
                    gpu_memory_bytes=int(args.gpu_memory_gib * GiB),
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    context=args.context,
                    prompt_tokens=args.prompt_tokens,
                ),
            )
            for role, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp))
        }
    except (OSError, ValueError) as e:  # unreadable config, TP that splits no heads, no GPU memory left
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    print("\n\n".join(render_plan(plan, f"{role} engine") for role, plan in plans.items()))
    for role, plan in plans.items():
        try:
            plan.check()
        except SizingError as e:
            print(f"pdserve plan: {role} engine: {e}", file=sys.stderr)
            return 2
    return 0


def _load_shape(args: argparse.Namespace) -> ModelShape:
    if not args.config:
        return ModelShape.from_model_dir(resolve_model(args.model))
    try:
        return ModelShape.from_config(json.loads(Path(args.config).read_text()))
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.config} is not JSON ({e}): pass a model's config.json") from None


if __name__ == "__main__":
    sys.exit(main())
