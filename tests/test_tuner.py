"""The ratio tuner (planner): model fit, simulator known answers, split search, CLI.
Pure Python and fast: no engines, no Ray."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.model import (
    SEEDS_PREFILL_TOKENS_PER_S,
    DecodeCost,
    HostContention,
    Layout,
    PerformanceModel,
    PrefillCost,
    TransferCost,
    fit_host,
    load_probe,
)
from planner.search import SearchSpace, capacity_bound, max_goodput, search
from planner.simulator import SLO, Lengths, Split, Workload, simulate

# The probe file's shape (what the cluster probe writes), with a few rows per phase.
PROBE_EXAMPLE = {
    "hardware": "4xH100",
    "model": "Qwen3.5-27B",
    "prefill": [
        {"prompt_tokens": 512, "batch_tokens": 512, "seconds": 0.16},
        {"prompt_tokens": 2048, "batch_tokens": 2048, "seconds": 0.63},
        {"prompt_tokens": 2048, "batch_tokens": 8192, "seconds": 2.51},
        {"prompt_tokens": 8192, "batch_tokens": 8192, "seconds": 2.62},
    ],
    "decode": [
        {"batch_size": 1, "context_tokens": 2000, "step_seconds": 0.0093},
        {"batch_size": 8, "context_tokens": 2000, "step_seconds": 0.0095},
        {"batch_size": 32, "context_tokens": 2000, "step_seconds": 0.0099},
        {"batch_size": 64, "context_tokens": 2000, "step_seconds": 0.0190},
        {"batch_size": 128, "context_tokens": 2000, "step_seconds": 0.0375},
    ],
    "transfer": [
        {"bytes": 50_000_000, "seconds": 0.003},
        {"bytes": 300_000_000, "seconds": 0.013},
        {"bytes": 1_000_000_000, "seconds": 0.041},
    ],
    "layout": {"attention_kv_bytes_per_token": 65536, "deltanet_state_bytes_per_request": 153944064},
    "serving": [
        {"prompt_tokens": 2048, "client_ttft_s": 0.660, "engine_s": 0.652},
        {"prompt_tokens": 8192, "client_ttft_s": 2.700, "engine_s": 2.690},
        {"prompt_tokens": 8192, "client_ttft_s": 2.900, "engine_s": 2.690},  # one stalled request
    ],
    "engines": {"device": "cuda", "prefill_tp": 4, "decode_tp": 4},
}

# Round numbers for hand-checked timelines: prefill 1 ms per token, decode 100 ms per step,
# instantaneous transfer.
TOY = PerformanceModel(
    hardware="toy",
    model="toy",
    prefill=PrefillCost(0.0, 1e-3, 0.0),
    decode=DecodeCost(0.1, 0.0, 0.0, 1.0, 0.0),
    transfer=TransferCost(0.0, 1e18),
    layout=Layout(0, 0),
)


# --- model -----------------------------------------------------------------------------


def _probe_from(model: PerformanceModel) -> dict:
    """Noise-free measurements of `model` on a grid like a real probe's."""
    prefill = [
        {"prompt_tokens": p, "batch_tokens": p * n, "seconds": model.prefill.seconds(p * n, p * p * n)}
        for p in (256, 1024, 4096)
        for n in (1, 2, 4)
    ]
    decode = [
        {"batch_size": b, "context_tokens": c, "step_seconds": model.decode.seconds(b, b * c)}
        for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
        for c in (500, 4000)
    ]
    transfer = [{"bytes": n, "seconds": model.transfer.seconds(n)} for n in (10**6, 10**7, 10**8, 10**9)]
    layout = {"attention_kv_bytes_per_token": 4096, "deltanet_state_bytes_per_request": 1 << 20}
    return {
        "hardware": "synthetic",
        "model": "m",
        "prefill": prefill,
        "decode": decode,
        "transfer": transfer,
        "layout": layout,
    }


def test_fit_recovers_known_parameters() -> None:
    truth = PerformanceModel(
        hardware="synthetic",
        model="m",
        prefill=PrefillCost(0.004, 3e-4, 2e-9),
        decode=DecodeCost(0.009, 1.2e-5, 5e-9, 24.0, 3e-4),
        transfer=TransferCost(0.002, 2.5e10),
        layout=Layout(4096, 1 << 20),
    )
    fitted = PerformanceModel.from_probe(_probe_from(truth))
    assert fitted.decode.knee == truth.decode.knee
    for got, want in (
        (fitted.prefill, truth.prefill),
        (fitted.decode, truth.decode),
        (fitted.transfer, truth.transfer),
    ):
        assert np.allclose(_params(got), _params(want), rtol=1e-6, atol=0)
        assert got.rms_relative_error < 1e-9
    assert fitted.layout == truth.layout


def _params(cost: PrefillCost | DecodeCost | TransferCost) -> list[float]:
    return [getattr(cost, f.name) for f in fields(cost) if f.name != "rms_relative_error"]


def test_fit_keeps_coefficients_non_negative() -> None:
    """Pure linear prefill with timing noise: an unconstrained fit may go negative on the
    quadratic term; this one stays >= 0 and close to the true slope."""
    rng = np.random.default_rng(1)
    rows = [
        {"prompt_tokens": p, "batch_tokens": p, "seconds": p / 3288 * rng.uniform(0.97, 1.03)}
        for p in range(256, 16384, 512)
    ]
    cost = PerformanceModel.from_probe({**PROBE_EXAMPLE, "prefill": rows}).prefill
    assert min(cost.fixed_s, cost.per_token_s, cost.per_token_pair_s) >= 0
    assert cost.seconds(8192, 8192**2) == pytest.approx(8192 / 3288, rel=0.05)


def test_probe_example_fits_and_round_trips(tmp_path: Path) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(PROBE_EXAMPLE))
    model = load_probe(probe)
    assert 24 <= model.decode.knee <= 40  # flat to ~32, then linear in the batch
    assert model.prefill.seconds(2048, 2048**2) == pytest.approx(0.63, rel=0.05)
    assert model.transfer.bytes_per_s == pytest.approx(2.5e10, rel=0.1)
    assert model.serving_overhead_s == pytest.approx(0.010)  # the median: the stall is not the path's cost
    saved = tmp_path / "model.json"
    model.save(saved)
    assert PerformanceModel.load(saved) == model
    seeds = PerformanceModel.seeds_example()
    assert PerformanceModel.from_dict(json.loads(json.dumps(seeds.to_dict()))) == seeds


def test_seeds_example_matches_the_headline_figures() -> None:
    seeds = PerformanceModel.seeds_example()
    assert 1000 / seeds.prefill.seconds(1000, 1000**2) == pytest.approx(3288)
    assert 1 / seeds.decode.seconds(1, 2000) == pytest.approx(108, rel=0.01)

    def step(batch: int) -> float:
        return seeds.decode.seconds(batch, batch * 2000)

    assert step(32) / step(1) < 1.1  # memory-bound: batching is almost free up to the knee
    assert step(128) / step(64) == pytest.approx(2, rel=0.1)  # compute-bound past it


def test_local_prefill_limit_is_where_computing_costs_what_a_handoff_does() -> None:
    seeds = PerformanceModel.seeds_example()
    kv, state = seeds.layout.attention_kv_bytes_per_token, seeds.layout.deltanet_state_bytes_per_request
    latency = seeds.transfer.latency_s

    def exact(bandwidth: float) -> int:  # u / 3288 <= latency + (state + u * kv) / bandwidth
        return int((latency + state / bandwidth) / (1 / SEEDS_PREFILL_TOKENS_PER_S - kv / bandwidth))

    assert seeds.local_prefill_limit() == exact(25e9) == 23  # 27B on 4xH100, one 200 Gb/s NIC
    # 10 Gb/s of TCP: moving 150 MB of state costs what computing ~500 tokens does.
    slow = replace(seeds, transfer=TransferCost(latency, 1.25e9))
    assert slow.local_prefill_limit() == exact(1.25e9) == 493
    # Attention's pair term caps what long suffixes are worth computing.
    pairs = replace(seeds, prefill=replace(seeds.prefill, per_token_pair_s=1e-6))
    assert pairs.local_prefill_limit() < seeds.local_prefill_limit()


# --- simulator -------------------------------------------------------------------------


def test_md1_waiting_time_matches_pollaczek_khinchine() -> None:
    """One prefill server, deterministic 1 s service (one 1000-token prompt per batch),
    Poisson arrivals at rho = 0.7: mean wait rho S / (2 (1 - rho))."""
    rho, service = 0.7, 1.0
    workload = Workload.poisson(40_000, Lengths(1000), Lengths(1), seed=0)
    timeline = simulate(TOY, Split(1, 1, token_budget=1000), workload, rho / service)
    wait = float(np.mean(timeline.prefill_start - timeline.arrival))
    assert wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.04)


def _two_requests() -> Workload:
    # A: 1000-token prompt, 11 tokens, at 0 s. B: 1000-token prompt, 2 tokens, at 1.45 s.
    return Workload.trace([(0.0, 1000, 11), (1.45, 1000, 2)])


def test_colocated_prefill_stalls_running_decode() -> None:
    """A is prefilled (0-1 s, first token), decodes 5 steps to 1.5 s, then B's prefill
    (1.5-2.5 s) stalls it; its last 5 steps end at 3.0 s. B joins the batch after its prefill."""
    workload = _two_requests()
    timeline = simulate(TOY, Split(0, 1), workload, workload.native_rate)
    assert timeline.first_token == pytest.approx([1.0, 2.5])
    assert timeline.last_token == pytest.approx([3.0, 2.6])
    assert timeline.tpot == pytest.approx([0.2, 0.1])


def test_disaggregated_prefill_makes_the_first_token() -> None:
    """A: prefill 0-1 s samples its first token, 10 decode steps 1.0-2.0 s. B: prefill
    1.45-2.45 s on the same prefill instance (A's is done), 1 decode step on the now idle
    decode instance. A one-token answer never reaches decode."""
    workload = _two_requests()
    timeline = simulate(TOY, Split(1, 1), workload, workload.native_rate)
    assert timeline.first_token == pytest.approx([1.0, 2.45])
    assert timeline.last_token == pytest.approx([2.0, 2.55])
    assert timeline.tpot == pytest.approx([0.1, 0.1])
    one_token = Workload.trace([(0.0, 1000, 1), (1.45, 1000, 1)])
    timeline = simulate(TOY, Split(1, 1), one_token, one_token.native_rate)
    assert timeline.last_token == pytest.approx(timeline.first_token) and timeline.peak_batch == 0


def test_a_prefix_hit_prefills_only_the_rest() -> None:
    """Both prompts 90% cached (900 of 1000 tokens): A prefills 100 tokens (0-0.1 s), B
    arrives at 1.45 s and prefills 100 (to 1.55 s). With a pair cost, each computed token
    still attends to its whole context."""
    workload = _two_requests().with_cached_share(0.9)
    assert workload.cached_tokens.tolist() == [900, 900]
    timeline = simulate(TOY, Split(1, 1), workload, workload.native_rate)
    assert timeline.first_token == pytest.approx([0.1, 1.55])
    pairs = replace(TOY, prefill=PrefillCost(0.0, 1e-3, 1e-6))
    timeline = simulate(pairs, Split(1, 1), workload, workload.native_rate)
    assert timeline.first_token[0] == pytest.approx(0.1 + 1e-6 * 100 * 1000)
    with pytest.raises(ValueError, match="cached share"):
        workload.with_cached_share(1.0)


def test_tune_counts_the_workloads_hit_rate() -> None:
    """RAG-like reuse makes prefill cheaper: the same traffic needs fewer prefill engines."""
    fresh = Workload.poisson(300, Lengths(2000, 0.2), Lengths(200, 0.2), seed=0)
    space = SearchSpace(gpus=24, batch_limits=(64,), include_colocated=False).sized_for(SEEDS)  # 6 instances
    slo = SLO(ttft_s=5.0, itl_s=0.1)
    cold, warm = (search(SEEDS, w, slo, space).best for w in (fresh, fresh.with_cached_share(0.8)))
    assert (cold.split.prefill, warm.split.prefill) == (5, 4)  # 80% hits: one prefill engine turns decode
    assert warm.goodput_rps > 3 * cold.goodput_rps


def test_serving_overhead_delays_what_the_client_sees_but_no_engine() -> None:
    """The path's fixed cost adds to TTFT and end-to-end time, not to inter-token times, and
    it does not hold an engine: B's prefill still starts when A's ends."""
    workload = _two_requests()
    plain = simulate(TOY, Split(1, 1), workload, workload.native_rate)
    timeline = simulate(replace(TOY, serving_overhead_s=0.02), Split(1, 1), workload, workload.native_rate)
    assert timeline.ttft == pytest.approx(plain.ttft + 0.02)
    assert timeline.e2e == pytest.approx(plain.e2e + 0.02)
    assert timeline.tpot == pytest.approx(plain.tpot)
    assert timeline.prefill_start == pytest.approx(plain.prefill_start)


def test_host_contention_fit_and_slowdown() -> None:
    rows = [{"tokens_per_s": t, "busy_cores": 0.1 + 0.002 * t} for t in (50.0, 150.0, 400.0)]
    host = fit_host({"engine_cores": 2, "rows": rows})
    assert host.cores == 2
    assert (host.background_cores, host.cpu_s_per_token) == pytest.approx((0.1, 0.002))
    assert host.slowdown(200) == pytest.approx(1 / (1 - 0.5 / 2))  # 0.5 busy cores of 2
    assert fit_host(None) is None  # GPU probes: engines do not share cores with the stack


def test_host_contention_stretches_engine_time_only() -> None:
    """At 1 req/s of 11-token answers the stack burns 0.5 of 1 core: every prefill and decode
    step takes twice as long, and nothing else changes."""
    workload = Workload.trace([(0.0, 1000, 11), (1.0, 1000, 11)])
    contended = replace(TOY, host=HostContention(1, 0.0, 0.5 / 11))
    plain = simulate(TOY, Split(1, 1), workload, 1.0)
    slow = simulate(contended, Split(1, 1), workload, 1.0)
    assert slow.ttft == pytest.approx(2 * plain.ttft)
    assert slow.tpot == pytest.approx(2 * plain.tpot)


def test_decode_batch_limit_queues_the_rest() -> None:
    """Three requests at once (instant prefill) on one decode instance limited to 2: the
    third joins when the first two finish their 3 steps (4 tokens: prefill samples the
    first). Same-instant arrivals share a step."""
    workload = Workload.trace([(0.0, 1, 4), (0.0, 1, 4), (0.0, 1, 4), (10.0, 1, 2)])
    instant_prefill = replace(TOY, prefill=PrefillCost(0.0, 0.0, 0.0))
    timeline = simulate(instant_prefill, Split(1, 1, batch_limit=2), workload, workload.native_rate)
    assert timeline.last_token == pytest.approx([0.3, 0.3, 0.6, 10.1])
    assert timeline.peak_batch == 2


# --- search ----------------------------------------------------------------------------

SEEDS = PerformanceModel.seeds_example()


def _brute_force_best_split(workload: Workload, slo: SLO, space: SearchSpace, rates: np.ndarray) -> tuple[int, float]:
    """The highest grid rate each split sustains within the SLO, then the best split.
    Sustains: at or below the split's steady-state capacity (300 requests of 1,000 tokens end
    before a decode slot is ever waited for, so a finite run alone would pass any rate)."""
    best = (0, 0.0)
    for prefill in space.splits():
        split = Split(prefill, space.instances - prefill, space.batch_limits[0])
        capacity = capacity_bound(SEEDS, split, workload).rate_rps
        passing = [
            r
            for r in rates
            if r <= capacity and simulate(SEEDS, split, workload, r).meets(slo).mean() >= slo.attainment_target
        ]
        rate = max(passing, default=0.0)
        if rate > best[1]:
            best = (prefill, rate)
    return best


@pytest.mark.parametrize(
    ("name", "prompt", "output", "slo", "expected_prefill"),
    [
        # Long prompts, short answers: prefill does ~all the work.
        ("prefill-bound", 4000, 8, SLO(ttft_s=5.0, itl_s=0.1), 5),
        # Short prompts, long answers: decode does.
        ("decode-bound", 100, 1000, SLO(ttft_s=2.0, itl_s=0.05), 1),
    ],
)
def test_search_finds_the_brute_force_optimum(
    name: str, prompt: int, output: int, slo: SLO, expected_prefill: int
) -> None:
    workload = Workload.poisson(300, Lengths(prompt, 0.2), Lengths(output, 0.2), seed=0)
    space = SearchSpace(gpus=24, batch_limits=(64,), include_colocated=False).sized_for(SEEDS)  # 6 instances
    result = search(SEEDS, workload, slo, space)
    top = max(c.goodput_rps for c in result.candidates)
    brute_prefill, brute_rate = _brute_force_best_split(workload, slo, space, np.linspace(0.1, 1.2, 45) * top)
    assert result.best.split.prefill == brute_prefill == expected_prefill, name
    assert result.best.goodput_rps == pytest.approx(brute_rate, rel=0.05)
    assert result.best.summary is not None and result.best.summary.attainment >= slo.attainment_target


def test_goodput_is_zero_when_the_slo_is_unreachable() -> None:
    workload = Workload.poisson(50, Lengths(2000), Lengths(10), seed=0)
    # A 2000-token prefill alone takes 0.6 s.
    candidate = max_goodput(SEEDS, Split(1, 1), workload, SLO(ttft_s=0.1, itl_s=1.0), gpus=2)
    assert candidate.goodput_rps == 0 and candidate.summary is None


def test_larger_batch_limits_reuse_an_unfilled_smaller_one() -> None:
    workload = Workload.poisson(100, Lengths(2000), Lengths(20), seed=0)
    space = SearchSpace(gpus=12, batch_limits=(16, 256))  # 3 instances of the seeds' 4 GPUs
    result = search(SEEDS, workload, SLO(2.0, 0.1), space)
    by_split = {}
    for candidate in result.candidates:
        by_split.setdefault(candidate.split.prefill, []).append(candidate)
    small, large = by_split[2]
    assert not small.limit_reached  # one decode instance, prefill-bound: never 16 running
    assert large.split.batch_limit == 256 and large.goodput_rps == small.goodput_rps


# --- command line ----------------------------------------------------------------------


def test_cli_fits_a_probe_and_writes_the_recommendation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(PROBE_EXAMPLE))
    out = tmp_path / "tune.json"
    argv = [
        "--probe", str(probe), "--save-model", str(tmp_path / "model.json"),
        "--gpus", "16", "--gpus-per-instance", "4", "--ttft-slo", "3", "--itl-slo", "0.05",
        "--prompt-tokens", "2000", "--output-tokens", "60", "--requests", "150",
        "--batch-limits", "32", "64", "--out", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    best = Split(**result["best"]["split"])
    assert f"recommended: {best.label}, decode batch limit {best.batch_limit}" in printed
    assert len(result["candidates"]) == 4 * 2  # colocated + 3 splits, 2 limits each
    assert PerformanceModel.load(tmp_path / "model.json") == PerformanceModel.from_probe(PROBE_EXAMPLE)
    assert out.with_suffix(".png").stat().st_size > 0


def test_cli_rejects_gpus_not_a_multiple_of_the_instance_size() -> None:
    with pytest.raises(SystemExit):
        main(["--seeds-example", "--gpus", "6", "--gpus-per-instance", "4", "--ttft-slo", "1", "--itl-slo", "0.1"])


# --- steady state: goodput never past capacity -----------------------------------------


def _hand_capacity(split: Split, prompt: int, output: int) -> tuple[float, str]:
    """From the seeds' per-token costs, by hand: prefill 1/3,288 s per prompt token with no
    fixed cost (batching does not help); decode with every batch at its limit, contexts at
    prompt + output/2 on average, one slot held for `output` - 1 steps (prefill samples the
    first token)."""
    d = SEEDS.decode
    limit = split.batch_limit
    step = (
        d.fixed_s
        + d.per_sequence_s * limit
        + d.per_context_token_s * limit * (prompt + output / 2)
        + d.compute_per_sequence_s * max(0, limit - d.knee)
    )
    prefill = split.prefill * SEEDS_PREFILL_TOKENS_PER_S / prompt
    decode = split.decode * limit / ((output - 1) * step)
    return (prefill, "prefill") if prefill < decode else (decode, "decode")


@pytest.mark.parametrize("prefill", [1, 4, 7])
def test_goodput_with_a_loose_slo_is_the_capacity_bound_whatever_the_run_length(prefill: int) -> None:
    """8 instances of 4xH100, 2,000-token prompts, 100-token answers, a TTFT SLO of 60 s
    (~100x one prefill: loose enough that even one prefill instance's queue meets it at 95%
    load). Before, with TTFT <= 10 s, 7P:1D reported 14.2 req/s with 600 requests and 11.8
    with 4,000, past the 11.5 req/s seven prefill instances can serve at all."""
    split = Split(prefill, 8 - prefill, 256)
    expected, pool = _hand_capacity(split, 2000, 100)
    slo = SLO(ttft_s=60.0, itl_s=0.1)
    goodputs = []
    for count in (600, 4000):
        workload = Workload.poisson(count, Lengths(2000, 0.0), Lengths(100, 0.0), seed=0)
        bound = capacity_bound(SEEDS, split, workload)
        assert bound.bound == pool and bound.rate_rps == pytest.approx(expected, rel=1e-9)
        candidate = max_goodput(SEEDS, split, workload, slo, gpus=32)
        assert expected * 0.95 <= candidate.goodput_rps <= expected
        goodputs.append(candidate.goodput_rps)
    assert goodputs[0] == pytest.approx(goodputs[1], rel=0.03)
    if prefill == 7:
        assert goodputs[0] <= 7 * 3288 / 2000  # 11.5 req/s


def test_decode_bound_split_is_capped_at_its_decode_capacity() -> None:
    split = Split(6, 1, 64)
    expected, pool = _hand_capacity(split, 200, 400)
    assert pool == "decode"
    workload = Workload.poisson(600, Lengths(200, 0.0), Lengths(400, 0.0), seed=0)
    candidate = max_goodput(SEEDS, split, workload, SLO(ttft_s=30.0, itl_s=0.5), gpus=28)
    assert candidate.capacity.bound == "decode"
    assert expected * 0.95 <= candidate.goodput_rps <= expected


def test_cli_says_when_no_split_meets_the_requested_rate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from planner.cli import main

    argv = [
        "--seeds-example", "--gpus", "32", "--gpus-per-instance", "4", "--prompt-tokens", "2000",
        "--output-tokens", "100", "--length-spread", "0", "--ttft-slo", "10", "--itl-slo", "0.1",
        "--requests", "300", "--batch-limits", "256", "--out", str(tmp_path / "t.json"),
    ]  # fmt: skip
    assert main([*argv, "--rate", "50"]) == 0
    out = capsys.readouterr().out
    assert "capacity" in out and "prefill-bound" in out
    assert "no split of 8 instances meets 50 req/s" in out
