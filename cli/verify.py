"""`pdserve verify`: after a deploy or an upgrade, check every prefill/decode pair of a live
cluster against colocated serving on the same engines.

For each pair and each prompt length, one request is prefilled on the prefill engine and
decoded on the decode engine over NIXL, then recomputed by the decode engine alone,
teacher-forced along the tokens it gave (router/shadow_verification.py): each token's logprob
must match. Each prompt runs twice, cold and then on the prefill engine's prefix cache (a
salt of its own per run keeps it apart from client traffic). TP pairings are whatever the
pairs run. Prints a pass/fail table and exits 1 if any check fails.

    pdserve verify --address HEAD:6379 [--prompt-lengths 64 1500] [--steps 16]
"""

from __future__ import annotations

import asyncio
import random
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from cluster.ray_cluster import join
from configuration.fields import knob
from messages.membership import ClusterView, Lifecycle, MemberState
from messages.requests import GenerateRequest, SamplingConfig
from router.shadow_verification import ShadowVerdict, decode_on_handle, verify


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    address: str = knob("auto", help="the cluster's Ray address (HEAD:6379; 'auto' on a cluster node)")
    prompt_lengths: tuple[int, ...] = knob((64, 1500), help="prompt lengths each pair hands off")
    steps: int = knob(16, help="generated tokens scored per check")

    def __post_init__(self) -> None:
        if not self.prompt_lengths or min(self.prompt_lengths) < 3:
            raise ValueError(f"prompt_lengths must be >= 3 tokens each, got {self.prompt_lengths}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


@dataclass(frozen=True, slots=True)
class Check:
    prompt_tokens: int
    cached_tokens: int  # the prefill engine's prefix hits
    verdict: ShadowVerdict

    def row(self) -> str:
        v = self.verdict
        outcome = "PASS" if v.agrees else f"FAIL at step {v.first_divergent_step}"
        return (
            f"| {v.prefill} -> {v.decode} | {self.prompt_tokens:,} | {self.cached_tokens:,} | {v.steps} | "
            f"{v.largest_gap_nats:.4f} | {outcome} |"
        )


async def check_pair(
    prefill: MemberState, decode: MemberState, prompt: tuple[int, ...], salt: str, steps: int
) -> Check:
    sampling = SamplingConfig(max_tokens=steps, ignore_eos=True, logprobs=0)
    request = GenerateRequest(f"verify-{uuid.uuid4().hex[:12]}", prompt, sampling, cache_salt=salt)
    result = await prefill.actor.prefill.remote(request)
    try:
        tokens, served = await decode_on_handle(decode.actor, result, request)
    except BaseException:
        if result.handle is not None:
            await decode.actor.release_transfer.remote(result.handle)
        raise
    verdict = await verify(decode.actor, request, tokens, served, prefill.name, decode.name)
    return Check(len(prompt), result.cached_tokens, verdict)


async def battery(view: ClusterView, config: VerifyConfig) -> list[Check]:
    """Every live pair, every prompt length, cold then on a prefix hit; one check at a time
    (the cluster keeps serving its traffic)."""
    rng, run = random.Random(), uuid.uuid4().hex[:8]
    live = [[m for m in pool if m.lifecycle is Lifecycle.LIVE] for pool in (view.prefill, view.decode)]
    checks = []
    for prefill in live[0]:
        for decode in live[1]:
            for n in config.prompt_lengths:
                prompt = tuple(rng.randrange(1, view.limits.vocab_size) for _ in range(n))
                salt = f"pdserve-verify-{run}-{prefill.name}-{decode.name}-{n}"
                for _ in ("cold", "prefix hit"):
                    checks.append(await check_pair(prefill, decode, prompt, salt, config.steps))
                    print(checks[-1].row(), flush=True)
    return checks


def run(config: VerifyConfig) -> int:
    from controller.actor import CONTROLLER_NAME

    join(config.address)
    view: ClusterView = ray.get(ray.get_actor(CONTROLLER_NAME).view.remote(), timeout=30)
    if view.colocated:
        print("pdserve verify: the cluster serves colocated (no prefill pool): no handoff to check")
        return 0
    print("| pair | prompt tokens | prefix hit tokens | steps | largest gap (nats) | result |")
    print("|---|---|---|---|---|---|")
    checks = asyncio.run(battery(view, config))
    failed = [c for c in checks if not c.verdict.agrees]
    print(f"{len(checks) - len(failed)} of {len(checks)} checks passed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> Any:
    import argparse

    from configuration.flags import add_flags, build

    parser = argparse.ArgumentParser(prog="pdserve verify", description=__doc__)
    add_flags(parser, VerifyConfig)
    try:
        config = build(VerifyConfig, parser.parse_args(argv))
    except ValueError as err:
        print(f"pdserve verify: {err}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
