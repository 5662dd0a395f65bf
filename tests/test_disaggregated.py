"""The core path with real vLLM, real NIXL and real Ray: one prefill and one decode engine,
each in its own actor process, against a colocated engine of the same configuration."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import pytest

from conftest import run, wait_until
from decode_worker import TransferFailedError
from kv_transfer.connector_config import TransferConfig
from kv_transfer.handle import HandleExpiredError
from router.orchestrator import GenerationResult
from vllm_engine.config import EngineConfig
from vllm_engine.requests import GenerateRequest, InvalidRequestError, SamplingConfig

LEASE_S = 6
MAX_TOKENS = 24
# bf16 greedy decoding: where the reference's top two candidates are closer than this,
# batch shape alone can flip the choice. Compare up to the first such near-tie.
NEAR_TIE_NATS = 0.1
MIN_COMPARED = 10



def _prompt(stride: int, offset: int, length: int) -> tuple[int, ...]:
    return tuple((stride * i + offset) % 2000 + 1 for i in range(length))


# Token-id prompts (vocabulary 2048): short, longer than one attention block (256 tokens
# here), several blocks; X and Y of equal length for the state-swap proof. Chosen so that
# the random-weight model's greedy reference has no near-tie in its first 10+ tokens.
PROMPTS = {
    "short": _prompt(17, 1, 17),
    "over_one_block": _prompt(41, 1, 300),
    "long": _prompt(7, 5, 1100),
    "x": _prompt(43, 5, 400),
    "y": _prompt(17, 2, 400),
}
# What decode must produce if it really continues Y's transferred state while being
# asked for X: prefill holds N-1 tokens of Y, decode feeds X's last token.
PROMPTS["y_then_last_of_x"] = PROMPTS["y"][:-1] + PROMPTS["x"][-1:]


def _request(name: str, request_id: str | None = None, logprobs: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id or name, PROMPTS[name], SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    )


@dataclasses.dataclass(frozen=True)
class Reference:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logprob at each position

    @property
    def decisive(self) -> list[int]:
        """The tokens before the first near-tie: any correct run must reproduce them."""
        k = next((i for i, m in enumerate(self.margins) if m < NEAR_TIE_NATS), len(self.tokens))
        return self.tokens[:k]


def assert_matches(tokens: list[int], ref: Reference) -> None:
    assert len(ref.decisive) >= MIN_COMPARED, "reference has near-ties too early to compare"
    assert tokens[: len(ref.decisive)] == ref.decisive
    assert len(tokens) == len(ref.tokens)


async def _collect(stream) -> tuple[list[int], GenerationResult | None]:
    tokens: list[int] = []
    result = None
    async for event in stream:
        if isinstance(event, GenerationResult):
            result = event
        else:
            tokens.extend(event.token_ids)
    return tokens, result


async def _decode_tokens(actor, request, handle=None) -> list[int]:
    tokens: list[int] = []
    async for ref in actor.generate.remote(request, handle):
        tokens.extend((await ref).token_ids)
    return tokens


async def _reference(actor, request) -> Reference:
    tokens: list[int] = []
    margins: list[float] = []
    async for ref in actor.generate.remote(request):
        chunk = await ref
        tokens.extend(chunk.token_ids)
        margins.extend(top[0][1] - top[1][1] for top in chunk.logprobs)
    return Reference(tokens, margins)


@pytest.fixture(scope="module")
def engine_config(model_path) -> EngineConfig:
    return EngineConfig(model=model_path)


@pytest.fixture(scope="module")
def reference(ray_cluster, engine_config) -> dict[str, Reference]:
    """Colocated outputs: same engine configuration, no connector, prefill and decode local."""
    from decode_worker.actor import DecodeActor

    actor = DecodeActor.remote("colocated", engine_config.with_cores("1"), None)
    try:
        return {
            name: run(_reference(actor, _request(name, f"ref-{name}", logprobs=2))) for name in PROMPTS
        }
    finally:
        ray_cluster.kill(actor, no_restart=True)


@pytest.fixture(scope="module")
def deployment(ray_cluster, engine_config, reference):
    from router.deployment import Deployment, DeploymentConfig

    dep = Deployment(DeploymentConfig(engine=engine_config, transfer=TransferConfig(lease_s=LEASE_S)))
    orchestrator = run(dep.start())
    yield dep, orchestrator
    dep.shutdown()


def _idle(dep) -> bool:
    import ray

    for member in dep.prefill.members + dep.decode.members:
        load = ray.get(member.actor.load.remote())
        if load.running or load.waiting or load.held_for_transfer or load.free_blocks != load.total_blocks:
            return False
    return True


def assert_no_blocks_held(dep, timeout_s: float = 5.0) -> None:
    assert wait_until(lambda: _idle(dep), timeout_s), "blocks still held on an engine"


def test_reference_outputs_differ_per_prompt(reference):
    # Guards the comparisons below: equal outputs for different prompts would prove nothing.
    assert len({tuple(v.decisive) for v in reference.values()}) == len(reference)
    assert all(len(v.tokens) == MAX_TOKENS and len(v.decisive) >= MIN_COMPARED for v in reference.values())


@pytest.mark.parametrize("name", ["short", "over_one_block", "long"])
def test_disaggregated_equals_colocated(deployment, reference, name):
    dep, orchestrator = deployment
    tokens, result = run(_collect(orchestrator.generate(_request(name, f"pd-{name}"))))
    assert_matches(tokens, reference[name])
    assert result.finish_reason == "length" and result.completion_tokens == MAX_TOKENS
    assert result.prompt_tokens == len(PROMPTS[name])
    assert result.timings.ttft_s >= result.timings.prefill_s > 0
    assert_no_blocks_held(dep)


def test_concurrent_requests_equal_colocated(deployment, reference):
    dep, orchestrator = deployment
    names = ["short", "over_one_block", "long", "x", "y", "short"]

    async def all_streams():
        return await asyncio.gather(
            *(_collect(orchestrator.generate(_request(n, f"conc-{i}-{n}"))) for i, n in enumerate(names))
        )

    outputs = run(all_streams())
    for name, (tokens, result) in zip(names, outputs):
        assert_matches(tokens, reference[name])
        assert result.finish_reason == "length"
    assert_no_blocks_held(dep)


def test_decode_continues_the_transferred_state_not_its_own_prompt(deployment, reference):
    """Decode is asked for X but handed Y's KV blocks and DeltaNet state: if the state
    really moved, it continues Y (plus X's last token), which differs from X's own output."""
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    y_handle = run(_prefill(prefill, _request("y", "swap-y"))).handle
    tokens = run(_decode_tokens(decode, _request("x", "swap-x"), y_handle))
    assert reference["x"].decisive[:MIN_COMPARED] != reference["y_then_last_of_x"].decisive[:MIN_COMPARED]
    assert_matches(tokens, reference["y_then_last_of_x"])
    assert_no_blocks_held(dep)


async def _prefill(actor, request):
    return await actor.prefill.remote(request)


def test_byte_accounting_matches_the_model(deployment, model_path):
    dep, _ = deployment
    prefill = dep.prefill.members[0].actor
    config = json.loads((Path(model_path) / "config.json").read_text())
    layer_types = config["layer_types"]
    n_attn = layer_types.count("full_attention")
    n_gdn = layer_types.count("linear_attention")
    # Attention: K and V per layer per token, bf16.
    attn_per_token = n_attn * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    # Gated DeltaNet: conv state (kernel-1) x conv channels in bf16 + fp32 temporal state.
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2
    temporal = config["linear_num_value_heads"] * config["linear_key_head_dim"] * config["linear_value_head_dim"] * 4
    layout = ray_get(prefill.state_layout.remote())
    block = next(g.block_size for g in layout.groups if g.block_size)

    seen = []
    for name in ["short", "over_one_block", "long"]:
        handle = run(_prefill(prefill, _request(name, f"bytes-{name}"))).handle
        # Prefill holds N-1 tokens on hybrids; whole blocks move.
        assert handle.num_tokens == len(PROMPTS[name]) - 1
        assert handle.bytes.attention_kv == math.ceil(handle.num_tokens / block) * block * attn_per_token
        assert handle.bytes.deltanet_state == n_gdn * (conv + temporal)
        seen.append(handle.bytes)
    assert seen[0].attention_kv < seen[1].attention_kv < seen[2].attention_kv
    assert len({b.deltanet_state for b in seen}) == 1
    # Never decoded: the producer's lease frees the blocks.
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)


def ray_get(ref):
    import ray

    return ray.get(ref)


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ((), SamplingConfig(), "prompt"),
        (_prompt(1, 0, 8190), SamplingConfig(max_tokens=8), "prompt"),
        ((1, 2, 3), SamplingConfig(max_tokens=0), "max_tokens"),
    ],
)
def test_bad_input_is_refused_by_router_and_workers(deployment, prompt, sampling, field):
    dep, orchestrator = deployment
    request = GenerateRequest(f"bad-{field}", prompt, sampling)
    with pytest.raises(InvalidRequestError) as err:
        run(_collect(orchestrator.generate(request)))
    assert err.value.field == field
    # Workers check too (they may be called by other routers).
    with pytest.raises(InvalidRequestError):
        run(_prefill(dep.prefill.members[0].actor, request))
    with pytest.raises(InvalidRequestError):
        run(_decode_tokens(dep.decode.members[0].actor, request))
    assert_no_blocks_held(dep)


def test_handle_for_unknown_engine_fails_cleanly(deployment):
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    handle = run(_prefill(prefill, _request("short", "ghost-src"))).handle
    ghost = dataclasses.replace(
        handle,
        engine_id="prefill-ghost",
        port=1,
        connector_params={**handle.connector_params, "remote_engine_id": "prefill-ghost", "remote_port": 1},
    )
    with pytest.raises(TransferFailedError, match="could not load"):
        run(_decode_tokens(decode, _request("short", "ghost-dst"), ghost))
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)


def test_expired_handle_is_refused_and_lease_frees_blocks(deployment):
    dep, _ = deployment
    prefill, decode = dep.prefill.members[0].actor, dep.decode.members[0].actor
    handle = run(_prefill(prefill, _request("long", "expire-src"))).handle
    load = ray_get(prefill.load.remote())
    assert load.held_for_transfer == 1 and load.free_blocks < load.total_blocks
    assert_no_blocks_held(dep, timeout_s=LEASE_S + 10)  # the lease ran out
    with pytest.raises(HandleExpiredError, match="expired"):
        run(_decode_tokens(decode, _request("long", "expire-dst"), handle))
    assert_no_blocks_held(dep)

