"""Decode step time of one in-process vLLM engine with the dim-first conv state NIXL needs:
vLLM's staged conv update against pdserve's in-place one (vllm_engine.conv_state_update),
interleaved in one process so both see the same machine.

    python -m bench.decode_step [--prompt-len 1024] [--output-len 300] [--rounds 5]

Run it pinned to one core (`taskset -c 1`) for the step time an engine on one core has.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5, help="requests per variant, alternating")
    parser.add_argument("--eager", action="store_true", help="eager instead of compiled (stock vLLM's default)")
    args = parser.parse_args(argv)

    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"})
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn
    from vllm import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    from vllm_engine.config import EngineConfig
    from vllm_engine.conv_state_update import install

    staged = gdn._causal_conv1d_update_cpu
    install()
    variants = {"vLLM staged": staged, "pdserve in place": gdn._causal_conv1d_update_cpu}
    print("building the engine ...", file=sys.stderr, flush=True)
    engine = LLMEngine.from_engine_args(EngineConfig(enforce_eager=args.eager).engine_args())
    prompt = [(31 * k + 3) % 2000 + 1 for k in range(args.prompt_len)]

    def decode_steps(request_id: str, output_len: int) -> list[float]:
        engine.add_request(
            request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=output_len, ignore_eos=True)
        )
        steps = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - started)
        return steps[1:]  # the first step is the prefill

    decode_steps("warm-up", 50)
    medians: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        for name, update in variants.items():
            gdn._causal_conv1d_update_cpu = update
            medians[name].append(statistics.median(decode_steps(f"{name}-{round_}", args.output_len)))
            print(
                f"round {round_ + 1}/{args.rounds} {name}: {medians[name][-1] * 1e3:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    staged_ms, in_place_ms = (statistics.median(medians[name]) * 1e3 for name in variants)
    print(
        f"decode step p50 ({args.prompt_len}-token prompt, {args.output_len} tokens, median of {args.rounds} requests):"
    )
    print(f"  vLLM staged conv update       {staged_ms:7.3f} ms")
    print(f"  pdserve in-place conv update  {in_place_ms:7.3f} ms   ({in_place_ms / staged_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
