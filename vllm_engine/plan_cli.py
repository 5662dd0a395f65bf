"""`pdserve plan`: size the prefill and decode engines from a model's config.json."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from configuration.fields import default_of, knob, section
from configuration.flags import add_flags, build
from vllm_engine.config import EMBEDDED_MODEL, EngineConfig, EngineSizing, resolve_model
from vllm_engine.sizing import GiB, ModelShape, SizingError, SizingInputs, plan_for, render_plan

# Engine flags that change nothing a plan counts (the batch token budget, compilation, ...).
PLAN_IGNORES = frozenset(
    {
        "max-num-batched-tokens",
        "prefill-max-num-batched-tokens",
        "decode-max-num-batched-tokens",
        "enforce-eager",
        "engine-path",
        "seed",
        "extra-engine-args",
    }
)


@dataclass(frozen=True, slots=True)
class PlanConfig:
    config: str | None = knob(None, help="a config.json file instead of a model directory (--model)")
    # The engines as `pdserve serve` takes them: the same flags plan what serve would start.
    engine: EngineConfig = section(EngineConfig, title="engines, both pools")
    prefill_sizing: EngineSizing = section(
        EngineSizing, title="prefill engines (override the shared flags)", prefix="prefill-"
    )
    decode_sizing: EngineSizing = section(
        EngineSizing, title="decode engines (override the shared flags)", prefix="decode-"
    )
    gpu_memory_gib: float = knob(
        default_of(SizingInputs, "gpu_memory_bytes") / GiB, help="memory of one GPU, GiB (80: an H100)"
    )
    prompt_tokens: int = knob(
        default_of(SizingInputs, "prompt_tokens"), help="prompt length for bytes moved and blocks cached per request"
    )
    context: int | None = knob(
        default_of(SizingInputs, "context"), help="tokens per request, for concurrency (unset: --max-model-len)"
    )
    link_gbit_s: tuple[float, ...] = knob(
        default_of(SizingInputs, "link_gbit_s"),
        flag="link-gbits",
        help="link rates, Gbit/s, for the transfer time per request (NIXL reaches a share of line rate)",
    )

    def __post_init__(self) -> None:
        if self.config is not None and self.engine.model != EMBEDDED_MODEL:
            raise ValueError("config: give a model directory (--model) or its config.json (--config), not both")
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib must be > 0, got {self.gpu_memory_gib}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if any(rate <= 0 for rate in self.link_gbit_s):
            raise ValueError(f"link_gbit_s: rates must be > 0, got {self.link_gbit_s}")
        if self.context is not None and self.context < 1:
            raise ValueError(f"context must be >= 1, got {self.context}")

    def shape(self) -> ModelShape:
        if not self.config:
            return ModelShape.from_model_dir(resolve_model(self.engine.model))
        try:
            return ModelShape.from_config(json.loads(Path(self.config).read_text()))
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.config} is not JSON ({e}): pass a model's config.json") from None

    def role_engine(self, role: str) -> EngineConfig:
        return self.engine.sized(self.prefill_sizing if role == "prefill" else self.decode_sizing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdserve plan",
        description="Weights, KV cache, DeltaNet state, blocks and concurrency per engine, from config.json alone.",
    )
    add_flags(parser, PlanConfig, PLAN_IGNORES)
    try:
        config = build(PlanConfig, parser.parse_args(argv))
        shape = config.shape()
        plans = {
            role: plan_for(
                config.role_engine(role),
                shape,
                gpu_memory_bytes=int(config.gpu_memory_gib * GiB),
                context=config.context,
                prompt_tokens=config.prompt_tokens,
                link_gbit_s=config.link_gbit_s,
            )
            for role in ("prefill", "decode")
        }
    except (OSError, ValueError) as e:  # a bad value, unreadable config, TP that splits no heads, no GPU memory left
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


if __name__ == "__main__":
    sys.exit(main())
