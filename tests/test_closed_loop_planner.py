"""The closed-loop planner on a simulated clock: window summaries, forecaster, correction
factors, and the decisions it makes on workloads served by the simulator itself (planner.replay).
Pure Python and fast: no engines, no Ray."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from test_layers import packages_loaded_by

from messages.timings import FinishedRequest
from planner.closed_loop import ClosedLoopPlanner, Corrections, PlannerConfig
from planner.model import PerformanceModel
from planner.observe import Forecast, IntervalObservation, forecast, summarize
from planner.replay import IntervalResult, Phase, Trace, goodput, replay, serve
from planner.search import SearchSpace, best_of, search
from planner.simulator import SLO, Lengths, Split, Workload

MODEL = PerformanceModel.seeds_example()  # Qwen3.5-27B, 4xH100 per instance
TARGET = SLO(ttft_s=2.0, itl_s=0.05)
INTERVAL = 30.0
# On 6 instances under TARGET (search, 100 requests): short prompts / long outputs are best
# served 2P:4D (12.8 req/s; 3P:3D 9.8), long prompts / short outputs 5P:1D (5.0; 4P:2D 3.8).
SHORT_LONG = (Lengths(512, 0.3), Lengths(1024, 0.3))
LONG_SHORT = (Lengths(3000, 0.3), Lengths(64, 0.3))
# Two splits within 3% of each other here: 1P:5D 12.8, 2P:4D 13.2 req/s.
BALANCED = (Lengths(256, 0.3), Lengths(1024, 0.3))


def _config(**overrides: object) -> PlannerConfig:
    settings: dict = {
        "instances": 6,
        "slo": TARGET,
        "interval_s": INTERVAL,
        "cooldown_s": 2 * INTERVAL,
        "search_requests": 100,
        **overrides,
    }
    return PlannerConfig(**settings)


def _run(
    phases: list[Phase], start: tuple[int, int], truth: PerformanceModel = MODEL, seed: int = 0, **overrides: object
) -> tuple[list[IntervalResult], ClosedLoopPlanner]:
    config = _config(**overrides)
    planner = ClosedLoopPlanner(config, MODEL)
    results = replay(truth, Trace.of(phases, seed=seed), config.split(*start), INTERVAL, TARGET, planner)
    return results, planner


def _changes(results: list[IntervalResult]) -> list[tuple[str, str]]:
    return [(r.decision.current.label, r.decision.recommended.label) for r in results if r.decision.changed]


def _request(arrival: float, prompt: int, output: int, ttft: float, itl: float) -> FinishedRequest:
    return FinishedRequest(arrival, prompt, output, ttft, itl)


# --- window summary, forecaster, corrections: known answers ----------------------------


def test_window_summary_known_answer() -> None:
    requests = (
        _request(12.0, 300, 30, 0.4, 0.02),
        _request(1.0, 100, 10, 0.1, 0.01),  # out of arrival order, as requests finish
        _request(5.0, 200, 20, 0.2, 0.03),
    )
    window = summarize(IntervalObservation(0.0, 20.0, 1, 2, requests, arrivals=5))
    assert window.arrival_rate_rps == 5 / 20  # the router's arrival count, not the finished one
    assert window.arrival_s.tolist() == [1.0, 5.0, 12.0]
    assert window.prompt_tokens.tolist() == [100, 200, 300]
    assert window.output_tokens.tolist() == [10, 20, 30]
    assert window.ttft_s.p50 == pytest.approx(0.2) and window.ttft_s.p90 == pytest.approx(0.36)
    assert window.itl_s.p50 == pytest.approx(0.02) and window.itl_s.p90 == pytest.approx(0.028)
    assert summarize(IntervalObservation(0.0, 20.0, 1, 2, requests)).arrival_rate_rps == 3 / 20


def test_observation_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="end after it starts"):
        IntervalObservation(10.0, 10.0, 1, 1, ())
    with pytest.raises(ValueError, match="token counts"):
        _request(0.0, 0, 1, 0.1, 0.01)


def test_forecast_smooths_the_rate_and_takes_the_latest_mix() -> None:
    old = Forecast(10.0, np.array([1000]), np.array([10]), np.array([0]))
    fresh = summarize(IntervalObservation(0.0, 10.0, 1, 1, tuple(_request(i, 50, 500, 0.1, 0.01) for i in range(200))))
    assert fresh.arrival_rate_rps == 20.0
    expected = forecast(old, fresh, rate_weight=0.5, min_requests=20)
    assert expected.rate_rps == 15.0
    assert expected.prompt_tokens.tolist() == [50] * 200 and expected.output_tokens.tolist() == [500] * 200
    # Too few requests to trust the mix: the rate still moves, the mix stays.
    sparse = summarize(IntervalObservation(0.0, 10.0, 1, 1, (_request(1.0, 7, 7, 0.1, 0.01),)))
    kept = forecast(old, sparse, rate_weight=0.25, min_requests=20)
    assert kept.rate_rps == pytest.approx(0.25 * 0.1 + 0.75 * 10.0)
    assert kept.prompt_tokens.tolist() == [1000]
    # The first window is the first forecast.
    assert forecast(None, fresh, rate_weight=0.5, min_requests=20).rate_rps == 20.0
    # The search workload carries the mix as observed pairs.
    workload = expected.workload(count=50, seed=0)
    assert len(workload) == 50 and set(workload.prompt_tokens.tolist()) == {50}


def test_the_forecast_keeps_each_requests_prefix_hit() -> None:
    """A RAG window: every other request found 900 of its 1000 prompt tokens cached (the
    router's journal records what the engine reported); the planner's workload keeps each
    request's hit with its lengths, so its prefill computes only the rest."""
    from messages.results import GenerationResult
    from messages.timings import LatencySummary, PhaseTimings, TransferBytes
    from router.journal import RequestJournal

    journal = RequestJournal()
    timings = PhaseTimings(0.0, 0.1, 0.0, 0.1, LatencySummary.of([]), 100.0, 0.2, TransferBytes(0, 0))
    for i in range(40):
        result = GenerationResult("length", 1000, 10, timings, "prefill-0", "decode-0", cached_tokens=900 * (i % 2))
        journal.finished(float(i), result)
    window = summarize(IntervalObservation(0.0, 40.0, 1, 1, journal.take().finished))
    assert window.cached_tokens.tolist() == [0, 900] * 20
    workload = forecast(None, window, rate_weight=0.5, min_requests=20).workload(count=400, seed=0)
    assert set(workload.uncached_tokens.tolist()) == {100, 1000}
    assert 0.4 < float(np.mean(workload.cached_tokens == 900)) < 0.6


def test_corrections_move_by_the_weighted_log_ratio_and_clamp() -> None:
    moved = Corrections().updated(ttft_ratio=1.44, itl_ratio=0.64, weight=0.5, bounds=(0.5, 2.0))
    assert moved.prefill == pytest.approx(1.2) and moved.decode == pytest.approx(0.8)
    clamped = Corrections(1.5, 0.6).updated(ttft_ratio=100.0, itl_ratio=0.01, weight=0.5, bounds=(0.5, 2.0))
    assert (clamped.prefill, clamped.decode) == (2.0, 0.5)
    assert Corrections(1.2, 0.9).updated(1.0, 1.0, 0.5, (0.5, 2.0)) == Corrections(1.2, 0.9)


def test_scaled_model_scales_prefill_and_decode_times_only() -> None:
    scaled = MODEL.scaled(prefill=1.5, decode=0.5)
    assert scaled.prefill.seconds(4096, 4096**2) == pytest.approx(1.5 * MODEL.prefill.seconds(4096, 4096**2))
    for batch in (1, 32, 100):  # both sides of the knee
        assert scaled.decode.seconds(batch, batch * 2000) == pytest.approx(
            0.5 * MODEL.decode.seconds(batch, batch * 2000)
        )
    assert scaled.decode.knee == MODEL.decode.knee and scaled.transfer == MODEL.transfer
    with pytest.raises(ValueError, match="positive"):
        MODEL.scaled(prefill=0.0)


def test_config_validates_itself() -> None:
    with pytest.raises(ValueError, match="hysteresis -0.1") as error:
        _config(hysteresis=-0.1, instances=1)
    assert "instances 1" in str(error.value)  # every problem at once
    with pytest.raises(ValueError, match="correction_bounds"):
        _config(correction_bounds=(1.2, 2.0))
    with pytest.raises(ValueError, match="rate_weight"):
        _config(rate_weight=0.0)


# --- search ----------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [SHORT_LONG, LONG_SHORT])
def test_best_of_agrees_with_the_full_search(lengths: tuple[Lengths, Lengths]) -> None:
    workload = Workload.poisson(100, *lengths, seed=3)
    full = search(MODEL, workload, TARGET, SearchSpace(6 * 4, batch_limits=(64,), include_colocated=False))
    splits = [c.split for c in full.candidates]
    mine, best = best_of(MODEL, workload, TARGET, splits, incumbent=splits[2])
    assert best.split == full.best.split and best.goodput_rps == full.best.goodput_rps
    assert mine.goodput_rps == full.candidates[2].goodput_rps


# --- the planner on a simulated clock --------------------------------------------------


def test_a_model_matching_the_cluster_predicts_the_window_exactly() -> None:
    results, planner = _run([Phase(3 * INTERVAL, 8.0, *SHORT_LONG)], start=(2, 4))
    for result in results:
        decision = result.decision
        assert decision.predicted_ttft_p90_s == pytest.approx(decision.observed_ttft_p90_s)
        assert decision.predicted_itl_p90_s == pytest.approx(decision.observed_itl_p90_s)
    assert planner.corrections == Corrections(1.0, 1.0)


def test_corrections_learn_the_clusters_error() -> None:
    truth = MODEL.scaled(prefill=1.3, decode=0.8)
    results, planner = _run([Phase(6 * INTERVAL, 5.0, *SHORT_LONG)], start=(2, 4), truth=truth)
    assert planner.corrections.prefill == pytest.approx(1.3, rel=0.05)
    assert planner.corrections.decode == pytest.approx(0.8, rel=0.05)
    last = results[-1].decision
    assert last.predicted_ttft_p90_s == pytest.approx(last.observed_ttft_p90_s, rel=0.1)


def test_shift_moves_the_split_toward_prefill_within_two_intervals_and_back() -> None:
    # Shifts fall inside an interval (at 3.5 and 7.5 intervals), the harder case.
    phases = [
        Phase(3.5 * INTERVAL, 8.0, *SHORT_LONG),
        Phase(4 * INTERVAL, 3.0, *LONG_SHORT),
        Phase(4.5 * INTERVAL, 8.0, *SHORT_LONG),
    ]
    results, _ = _run(phases, start=(2, 4))
    # Prefill instances of each change, by the interval it was decided at.
    changes = {i: r.decision.recommended.prefill for i, r in enumerate(results) if r.decision.changed}
    running = [r.split.prefill for r in results]
    # The shift lands in interval 3: the first change, toward prefill, at the end of 3 or 4.
    # (A window holding both mixes shows an intermediate one: a step there may come first.)
    toward = min(changes)
    assert toward in (3, 4) and changes[toward] > 2
    assert all(changes[i] > running[i] for i in changes if i < 7)  # every change before the way back adds prefill
    # The way back lands in interval 7: a change to fewer prefill instances at the end of 7 or 8.
    back = min(i for i in changes if i >= 7)
    assert back in (7, 8) and changes[back] < running[back]
    assert all(changes[i] < running[i] for i in changes if i >= 7)
    assert results[-1].split.label == "2P:4D"


def test_steady_workload_causes_no_change() -> None:
    results, _ = _run([Phase(8 * INTERVAL, 8.0, *SHORT_LONG)], start=(2, 4))
    assert _changes(results) == []
    reasons = [r.decision.reason for r in results]
    assert all(reason == "the running split is the best" or "under the hysteresis" in reason for reason in reasons)


def test_steady_workload_on_a_poor_split_changes_once() -> None:
    results, _ = _run([Phase(6 * INTERVAL, 8.0, *SHORT_LONG)], start=(4, 2))
    assert _changes(results) == [("4P:2D", "2P:4D")]
    assert results[0].decision.changed  # at the first interval: nothing to wait for


def _noisy(seed: int, intervals: int, rate: float) -> list[Phase]:
    """One phase per interval around BALANCED: rate x 0.7-1.3, mean lengths x 0.85-1.15."""
    rng = np.random.default_rng(seed)
    prompt, output = BALANCED
    return [
        Phase(
            INTERVAL,
            rate * rng.uniform(0.7, 1.3),
            Lengths(prompt.mean * rng.uniform(0.85, 1.15), prompt.spread),
            Lengths(output.mean * rng.uniform(0.85, 1.15), output.spread),
        )
        for _ in range(intervals)
    ]


@pytest.mark.parametrize("rate", [8.0, 11.0])
def test_noisy_workload_does_not_oscillate(rate: float) -> None:
    # Around 60% and 85% of the best goodput (~13 req/s); at 11 the jitter reaches past it.
    results, _ = _run(_noisy(seed=1, intervals=12, rate=rate), start=(2, 4))
    assert len(_changes(results)) <= 1  # at most one move, never back and forth
    # The noise was real: some intervals' mixes favoured the other split.
    assert any(r.decision.recommended != r.decision.current for r in results)


def test_cooldown_holds_a_second_change() -> None:
    # Long prompts for one interval, then short again: the way back waits out the cool-down.
    phases = [Phase(INTERVAL, 3.0, *LONG_SHORT), Phase(4 * INTERVAL, 8.0, *SHORT_LONG)]
    results, _ = _run(phases, start=(2, 4), cooldown_s=3 * INTERVAL)
    decisions = [r.decision for r in results]
    assert decisions[0].changed and decisions[0].recommended.prefill > 2
    held = [d for d in decisions[1:3] if "cool-down" in d.reason]
    assert held and all(not d.changed for d in held)
    assert decisions[3].changed and decisions[3].recommended.label == "2P:4D"


def test_a_split_off_the_budget_is_judged_against_the_budgets_splits() -> None:
    # An engine lost: 2P:3D running on a budget of 6. It has no row in the search; it is
    # evaluated alone, and the recommendation uses the whole budget.
    planner = ClosedLoopPlanner(_config(), MODEL)
    running = Split(2, 3)
    trace = Trace.of([Phase(INTERVAL, 8.0, *SHORT_LONG)])
    observation = serve(MODEL, trace, 0.0, INTERVAL, running, running, changeover_s=0.0)
    decision = planner.step(observation)
    assert decision.current.label == "2P:3D" and decision.recommended.label == "2P:4D"
    assert decision.recommended_goodput_rps > decision.current_goodput_rps > 0


def test_too_few_requests_hold_without_searching() -> None:
    results, planner = _run([Phase(2 * INTERVAL, 0.3, *SHORT_LONG)], start=(4, 2))
    for result in results:
        assert not result.decision.changed and result.decision.search_s == 0.0
        assert "fewer than 20" in result.decision.reason
    assert planner.corrections == Corrections()


def test_each_decision_is_logged_as_one_line_with_its_figures(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="planner.closed_loop"):
        results, _ = _run([Phase(INTERVAL, 8.0, *SHORT_LONG)], start=(4, 2))
    (line,) = [record.getMessage() for record in caplog.records]
    assert "\n" not in line and line == results[0].decision.log_line()
    for part in (
        "planner t=30s change 4P:2D -> 2P:4D",
        "clears the hysteresis 10%",
        "goodput",
        "forecast",
        "TTFT p90 observed",
        "ITL p90 observed",
        "corrections prefill x1.00 decode x1.00",
        "search",
    ):
        assert part in line


def test_changeover_serves_with_the_shared_instances_first() -> None:
    trace = Trace.of([Phase(INTERVAL, 3.0, *LONG_SHORT)], seed=1)
    before, after = Split(2, 4), Split(5, 1)
    direct = serve(MODEL, trace, 0.0, INTERVAL, after, after, changeover_s=0.0)
    slowed = serve(MODEL, trace, 0.0, INTERVAL, before, after, changeover_s=10.0)
    assert len(direct.requests) == len(slowed.requests) == len(trace.arrival_s)
    early = [i for i, r in enumerate(direct.requests) if r.arrival_s < 10.0]
    # 2 prefill instances (the shared ones) instead of 5 for the first 10 s: slower first tokens.
    assert early and sum(slowed.requests[i].ttft_s for i in early) > sum(direct.requests[i].ttft_s for i in early)
    assert (slowed.prefill, slowed.decode) == (5, 1)  # the observation names the split it changed to
    assert goodput([IntervalResult(after, direct, 3, None)]) == 3 / INTERVAL


def test_the_planner_imports_no_engine_or_cluster_packages() -> None:
    """The controller runs it every interval: no vLLM, torch or Ray, and no bench."""
    loaded = packages_loaded_by("planner.closed_loop, planner.observe, planner.replay")
    assert not loaded & {"vllm", "torch", "ray", "bench"}, loaded
