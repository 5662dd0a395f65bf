"""bench.tuner_validation's comparison: predicted vs measured p50s, relative errors, the 25%
target, and the load generator's requests handed to the simulator unchanged. Synthetic
inputs only: no engines, no Ray (the module imports neither)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from bench.loadgen import (
    DEFAULT_SLO,
    PROFILES,
    RequestRecord,
    RunReport,
    summarize,
    synthetic_workload,
)
from bench.tuner_validation import (
    TOLERANCE,
    Point,
    compare,
    completed_indices,
    error_summary,
    fit_model,
    measured_p50s,
    per_request,
    split_of,
    predict,
    predicted_p50s,
    relative_error,
    summary_lines,
    table,
    workload_of,
)
from planner.model import (
    DecodeCost,
    Layout,
    PerformanceModel,
    PrefillCost,
    TransferCost,
)
from planner.simulator import Split, Timeline
from planner.trace import RequestSpec
from vllm_engine.config import EngineConfig

# Prefill 1 ms per token, decode 100 ms per step, transfer 10 ms flat.
TOY = PerformanceModel(
    hardware="toy",
    model="toy",
    prefill=PrefillCost(0.0, 1e-3, 0.0),
    decode=DecodeCost(0.1, 0.0, 0.0, 1.0, 0.0),
    transfer=TransferCost(0.01, 1e18),
    layout=Layout(0, 0),
)


def test_imports_neither_vllm_nor_ray() -> None:
    code = "import sys, bench.tuner_validation; print('vllm' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_relative_error() -> None:
    assert relative_error(1.2, 1.0) == pytest.approx(0.2)
    assert relative_error(0.5, 1.0) == pytest.approx(-0.5)
    assert relative_error(None, 1.0) is None
    assert relative_error(1.0, None) is None
    assert relative_error(1.0, 0.0) is None


def test_compare_flags_the_target_both_ways() -> None:
    points = compare("1P:1D", 1.0, {"ttft": 0.30, "itl": 0.010}, {"ttft": 0.25, "itl": 0.020})
    ttft, itl = points
    assert (ttft.metric, itl.metric) == ("ttft", "itl")
    assert ttft.relative_error == pytest.approx(0.2) and ttft.within_target
    assert itl.relative_error == pytest.approx(-0.5) and not itl.within_target
    # The boundary is inclusive; a missing measurement is not comparable.
    edge, missing = compare("x", 1.0, {"ttft": 1.25, "itl": 0.01}, {"ttft": 1.0, "itl": None})
    assert edge.within_target and edge.relative_error == pytest.approx(TOLERANCE)
    assert missing.relative_error is None and missing.within_target is None


def _timeline(ttft: list[float], tpot: list[float], outputs: list[int]) -> Timeline:
    arrival = np.arange(len(ttft), dtype=float)
    first = arrival + np.array(ttft)
    output = np.array(outputs)
    last = first + np.array(tpot) * np.maximum(output - 1, 1)
    return Timeline(arrival, arrival, first, last, output, 1)


def test_predicted_p50s_over_the_chosen_requests() -> None:
    timeline = _timeline([0.1, 0.2, 0.3, 0.4, 9.0], [0.01, 0.02, 0.03, 0.04, 0.05], [10, 10, 10, 1, 10])
    everything = predicted_p50s(timeline)
    assert everything["ttft"] == pytest.approx(0.3)
    # Single-token outputs have no ITL: left out (request 3).
    assert everything["itl"] == pytest.approx(0.025)
    # Only the requests the load generator completed (here not request 4).
    chosen = predicted_p50s(timeline, [0, 1, 2, 3])
    assert chosen["ttft"] == pytest.approx(0.25)  # interpolated, as bench.loadgen.percentile does
    assert chosen["itl"] == pytest.approx(0.02)
    assert predicted_p50s(timeline, []) == {"ttft": None, "itl": None}


def _record(index: int, ttft: float, gap: float, tokens: int, error: str = "") -> RequestRecord:
    times = tuple(ttft + gap * k for k in range(tokens))
    return RequestRecord(index, 1000, tokens, float(index), float(index), times, times[-1], "length", error)


def _report(records: list[RequestRecord]) -> RunReport:
    return RunReport("t", 1.0, DEFAULT_SLO, summarize(records, DEFAULT_SLO), records)


def test_measured_p50s_and_completed_requests() -> None:
    records = [
        _record(0, 0.2, 0.010, 50),
        _record(1, 0.3, 0.012, 50),
        _record(2, 0.4, 0.020, 50),
        _record(3, 5.0, 0.100, 50, error="DEADLINE_EXCEEDED"),  # failed: not in the percentiles
    ]
    report = _report(records)
    measured = measured_p50s(report)
    assert measured["ttft"] == pytest.approx(0.3)
    assert measured["itl"] == pytest.approx(0.012)  # per-request mean gaps, p50 over requests
    assert completed_indices(report) == [0, 1, 2]


def test_per_request_rows_pair_prediction_and_measurement() -> None:
    timeline = _timeline([0.1, 0.2], [0.01, 0.02], [50, 50])
    report = _report([_record(1, 0.25, 0.02, 50, error="DEADLINE_EXCEEDED"), _record(0, 0.15, 0.01, 50)])
    first, second = per_request(timeline, report)
    assert first["index"] == 0 and first["predicted_ttft_s"] == pytest.approx(0.1)
    assert first["measured_ttft_s"] == pytest.approx(0.15) and first["measured_itl_s"] == pytest.approx(0.01)
    assert second["predicted_itl_s"] == pytest.approx(0.02) and second["measured_ttft_s"] is None


def test_workload_is_the_load_generators_requests_unchanged() -> None:
    specs = synthetic_workload(1.5, 20, PROFILES["default"], 0)
    workload = workload_of(list(reversed(specs)))  # order of the list does not matter, indices do
    assert np.array_equal(workload.arrivals(1.0), [s.arrival_s for s in specs])
    assert workload.prompt_tokens.tolist() == [s.prompt_tokens for s in specs]
    assert workload.output_tokens.tolist() == [s.output_tokens for s in specs]
    with pytest.raises(ValueError):
        workload_of(specs[1:])


def test_predict_on_a_hand_checked_trace() -> None:
    """1P:1D, two far-apart requests: prefill (0.1 s per 100 tokens) samples the first token,
    then transfer 0.01 s and 0.1 s per decode step: the first gap carries the transfer."""
    specs = [RequestSpec(0, 0.0, 100, 5), RequestSpec(1, 10.0, 200, 3)]
    split = Split(1, 1, batch_limit=16, token_budget=8192)
    timeline = predict(TOY, split, specs)
    assert np.allclose(timeline.arrival, [0.0, 10.0])
    assert np.allclose(timeline.ttft, [0.1, 0.2])
    assert np.allclose(timeline.last_token - timeline.first_token, [0.01 + 4 * 0.1, 0.01 + 2 * 0.1])
    colocated = predict(TOY, Split(0, 2, 16, 8192), specs)
    assert np.allclose(colocated.ttft, [0.1, 0.2])  # the prefill samples the first token here too


def test_split_follows_the_engine_config() -> None:
    class System:
        num_prefill, num_decode = 1, 1

    split = split_of(System(), EngineConfig())
    assert (split.prefill, split.decode) == (1, 1)
    assert split.batch_limit == EngineConfig().max_num_seqs == 16
    assert split.token_budget == EngineConfig().max_num_batched_tokens


def test_fit_model_falls_back_on_flat_transfer_rows() -> None:
    probe = {
        "hardware": "cpu",
        "model": "m",
        "prefill": [
            {"prompt_tokens": p, "batch_tokens": p * n, "seconds": 0.01 + 2e-4 * p * n}
            for p in (512, 1024)
            for n in (1, 2)
        ],
        "decode": [
            {"batch_size": b, "context_tokens": 1000, "step_seconds": 0.008 + 0.001 * b} for b in (1, 2, 4, 8, 16)
        ],
        "transfer": [{"bytes": 1_000_000, "seconds": 0.009}, {"bytes": 4_000_000, "seconds": 0.007}],
        "layout": {"attention_kv_bytes_per_token": 1024, "deltanet_state_bytes_per_request": 411648},
    }
    model, note = fit_model(probe)
    assert "median" in note
    assert model.transfer_seconds(1000) == pytest.approx(0.008)
    assert model.prefill.seconds(1000, 1000**2) == pytest.approx(0.21, rel=1e-3)
    probe["transfer"][1]["seconds"] = 0.020
    assert fit_model(probe)[1] == "fitted"


def test_error_summary_and_table() -> None:
    points = [
        *compare("1P:1D", 0.5, {"ttft": 0.30, "itl": 0.010}, {"ttft": 0.25, "itl": 0.020}),
        *compare("2 colocated", 0.5, {"ttft": 0.20, "itl": 0.011}, {"ttft": 0.25, "itl": 0.010}),
        Point("2 colocated", 1.0, "ttft", 0.2, None, None, None),
    ]
    errors = error_summary(points)
    assert errors["ttft"] == {
        "points": 2,
        "within_target": 2,
        "mean_abs_error": pytest.approx(0.2),
        "max_abs_error": pytest.approx(0.2),
    }
    assert errors["itl"]["points"] == 2 and errors["itl"]["within_target"] == 1
    assert errors["itl"]["max_abs_error"] == pytest.approx(0.5)
    assert errors["all"]["points"] == 4 and errors["all"]["within_target"] == 3
    text = table(points[:4])
    assert "+20% yes" in text and "-50%  no" in text and "2 colocated" in text
    assert summary_lines(errors)[0].startswith("ttft: 2/2 within 25%")
