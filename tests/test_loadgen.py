"""The load generator: arrivals, lengths, traces, statistics (pure), then a short run of its
command line against a real in-process deployment behind the gRPC server."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.loadgen import (
    DEFAULT_SLO,
    PROFILES,
    TOKEN_ID_RANGE,
    LoadConfig,
    RequestRecord,
    RunReport,
    format_row,
    parse_trace,
    poisson_arrivals,
    prompt_ids,
    replay,
    require_loopback,
    summarize,
    sweep_http,
    synthetic_workload,
)
from messages.timings import SLO, percentile
from planner.trace import RequestSpec

REPO = Path(__file__).resolve().parents[1]


# --- arrivals --------------------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_exponential_gaps():
    rate, count = 4.0, 20_000
    times = poisson_arrivals(rate, count, random.Random(7))
    assert times == sorted(times) and times[0] >= 0
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1
    # Counts per 1 s window are Poisson: variance equals the mean (dispersion 1).
    counts = np.bincount(np.asarray(times, dtype=int))[:-1]
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


def test_arrivals_are_seeded_and_scale_with_rate():
    assert poisson_arrivals(2.0, 50, random.Random(1)) == poisson_arrivals(2.0, 50, random.Random(1))
    slow = synthetic_workload(1.0, 50, PROFILES["default"], seed=3)
    fast = synthetic_workload(4.0, 50, PROFILES["default"], seed=3)
    # The same requests at every rate, only closer together.
    assert [(s.prompt_tokens, s.output_tokens) for s in slow] == [(f.prompt_tokens, f.output_tokens) for f in fast]
    assert [s.arrival_s / 4 for s in slow] == pytest.approx([f.arrival_s for f in fast])


def test_invalid_rate_and_bounds_are_refused():
    with pytest.raises(ValueError):
        poisson_arrivals(0.0, 10, random.Random(0))
    with pytest.raises(ValueError):
        LoadConfig(num_requests=0)
    with pytest.raises(ValueError):
        LoadConfig(time_limit_s=float("inf"))


# --- lengths ---------------------------------------------------------------------------


def _samples(name: str, n: int = 5000) -> list[tuple[int, int]]:
    rng = random.Random(11)
    return [PROFILES[name].sample(rng) for _ in range(n)]


def test_default_profile_is_about_1000_in_50_out():
    samples = _samples("default")
    prompts, outputs = zip(*samples)
    assert statistics.mean(prompts) == pytest.approx(1000, rel=0.03)
    assert statistics.mean(outputs) == pytest.approx(50, rel=0.02)
    assert min(outputs) == 40 and max(outputs) == 60
    assert statistics.mean(p / o for p, o in samples) == pytest.approx(20, rel=0.02)


def test_rag_profile_spans_19_to_47():
    ratios = [p / o for p, o in _samples("rag")]
    # Prompt lengths are rounded to whole tokens: ratios may pass the bounds by 0.5 / output.
    assert 19 - 0.5 / 40 <= min(ratios) < 20 and 46 < max(ratios) <= 47 + 0.5 / 40


def test_fixed_profile_is_3000_in_150_out():
    assert set(_samples("fixed", 50)) == {(3000, 150)}


def test_prompts_are_seeded_token_ids_in_range():
    spec = RequestSpec(3, 0.0, 500, 10)
    ids = prompt_ids(spec, seed=5)
    assert len(ids) == 500 and all(TOKEN_ID_RANGE[0] <= i < TOKEN_ID_RANGE[1] for i in ids)
    assert ids == prompt_ids(spec, seed=5) and ids != prompt_ids(spec, seed=6)
    assert ids != prompt_ids(RequestSpec(4, 0.0, 500, 10), seed=5)


# --- traces ----------------------------------------------------------------------------


def test_trace_lines_are_parsed_and_sorted_by_arrival():
    lines = [
        '{"arrival_s": 1.5, "prompt_tokens": 3000, "output_tokens": 150}',
        "",
        '{"arrival_s": 0.25, "prompt_tokens": 1000, "output_tokens": 50, "note": "ignored"}',
    ]
    assert parse_trace(lines) == [RequestSpec(0, 0.25, 1000, 50), RequestSpec(1, 1.5, 3000, 150)]


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"arrival_s": 0, "prompt_tokens": 10}',
        '{"arrival_s": -1, "prompt_tokens": 10, "output_tokens": 5}',
        '{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 5}',
        '{"arrival_s": "soon", "prompt_tokens": 10, "output_tokens": 5}',
    ],
)
def test_bad_trace_lines_name_their_line(line):
    with pytest.raises(ValueError, match="trace line 2"):
        parse_trace(['{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}', line])


def test_empty_trace_is_refused():
    with pytest.raises(ValueError, match="no requests"):
        parse_trace(["", "  "])


# --- statistics ------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    values = [random.Random(2).random() for _ in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def _record(index: int, sent_s: float, ttft_s: float, gaps: list[float], error: str = "", output: int = 0):
    times = [ttft_s]
    for gap in gaps:
        times.append(times[-1] + gap)
    end = times[-1] + 0.001
    return RequestRecord(
        index, 100, output or len(times), 0.0, sent_s, tuple(times), end, "" if error else "length", error
    )


def test_goodput_counts_requests_meeting_both_slos():
    slo = SLO(ttft_s=1.0, itl_s=0.025)
    records = [
        _record(0, 0.0, 0.2, [0.01] * 9),  # good
        _record(1, 0.2, 1.5, [0.01] * 9),  # TTFT too late
        _record(2, 0.4, 0.2, [0.05] * 9),  # ITL too slow
        _record(3, 0.6, 0.2, [0.01] * 4, error="DEADLINE_EXCEEDED", output=10),  # cut short
    ]
    duration = records[1].sent_s + records[1].end_s  # the last to finish; the first was sent at 0
    summary = summarize(records, slo)
    assert (summary.sent, summary.completed, summary.good) == (4, 3, 1)
    assert summary.duration_s == pytest.approx(duration)
    assert summary.goodput_rps == pytest.approx(1 / duration)
    assert summary.slo_attainment == 0.25
    assert summary.throughput_rps == pytest.approx(3 / duration)
    assert summary.output_tokens_per_s == pytest.approx(35 / duration)  # tokens of the failed one count
    assert summary.ttft_s.p50 == pytest.approx(0.2) and summary.ttft_s.p99 == pytest.approx(1.474)
    assert summary.request_itl_s.p50 == pytest.approx(0.01)
    assert summary.itl_s.p90 == pytest.approx(0.05)  # 27 gaps, a third of them 50 ms
    assert summary.e2e_s.p50 == pytest.approx(0.651)
    short = _record(4, 0.8, 0.2, [0.01] * 2, output=10)  # the stream ended early, no error
    line = format_row(RunReport("run", 1.0, slo, summarize([*records, short], slo), [*records, short]))
    assert line.endswith("| not done: 1 DEADLINE_EXCEEDED | not done: 1 3 of 10 tokens")


def test_per_request_itl_statistic_mean_or_p90():
    stalled = _record(0, 0.0, 0.2, [0.01] * 19 + [1.0])  # one 1 s stall in 20 gaps
    assert stalled.itl_s("mean") == pytest.approx(0.0595)
    assert stalled.itl_s("p90") == pytest.approx(0.01)
    assert not stalled.meets(SLO(1.0, 0.025, itl_stat="mean"))
    assert stalled.meets(SLO(1.0, 0.025, itl_stat="p90"))
    assert _record(1, 0.0, 0.2, []).meets(DEFAULT_SLO)  # one token: no gap to miss


def test_empty_run_summarizes_to_no_values():
    summary = summarize([], DEFAULT_SLO)
    assert summary.sent == summary.good == 0 and summary.ttft_s.p50 is None and summary.goodput_rps == 0


def test_only_loopback_targets():
    for target in ("127.0.0.1:1", "localhost:1", "[::1]:1"):
        require_loopback(target)
    with pytest.raises(ValueError, match="loopback"):
        require_loopback("10.1.2.3:50051")


# --- against a real deployment ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(shared_deployment, model_path):
    from conftest import ServedStack

    served = ServedStack(shared_deployment, model_path, http_model="loadgen")
    try:
        yield served.server, served.loop, served.http
    finally:
        served.close()


def test_command_line_run_completes_every_request_with_its_length(server, tmp_path):
    srv, _, _ = server
    out = tmp_path / "run.json"
    command = [sys.executable, "-m", "bench.loadgen", "--target", srv.address, "--rate", "2"]
    command += ["--num-requests", "5", "--time-limit", "120", "--warmup", "1", "--no-progress", "--out", str(out)]
    done = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    (report,) = json.loads(out.read_text())
    requests = report["requests"]
    assert len(requests) == 5
    for r in requests:
        assert r["error"] == "" and r["finish_reason"] == "length"
        assert len(r["token_times_s"]) == r["output_tokens"] and 40 <= r["output_tokens"] <= 60
    s = report["summary"]
    assert s["sent"] == s["completed"] == 5
    for name in ("ttft_s", "itl_s", "request_itl_s", "e2e_s"):
        assert all(value is not None and value >= 0 for value in s[name].values()), name
    assert s["ttft_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["ttft_s"]["p99"]
    assert s["throughput_rps"] > 0 and s["output_tokens_per_s"] > 0
    assert 0 <= s["good"] <= 5 and s["goodput_rps"] >= 0 and 0 <= s["slo_attainment"] <= 1
    assert "goodput" in done.stdout
    if _has_matplotlib():
        assert (tmp_path / "run_cdf.png").stat().st_size > 0


def test_trace_replay_keeps_the_trace_schedule(server):
    srv, loop, _ = server
    specs = parse_trace(
        [
            '{"arrival_s": 0.0, "prompt_tokens": 300, "output_tokens": 5}',
            '{"arrival_s": 0.5, "prompt_tokens": 40, "output_tokens": 12}',
        ]
    )
    config = LoadConfig(num_requests=10, time_limit_s=60, warmup=0, progress=False)
    report = asyncio.run_coroutine_threadsafe(replay(srv.address, specs, config), loop).result(timeout=120)
    assert [len(r.token_times_s) for r in report.requests] == [5, 12]
    assert all(r.completed for r in report.requests)
    assert report.requests[1].sent_s >= 0.5


def test_the_openai_front_takes_the_same_load(server):
    """`sweep_http`: Poisson requests through /v1/completions, each event's tokens counted
    (logprobs 0), so its records read as the gRPC ones do."""
    _, loop, http = server
    config = LoadConfig(num_requests=3, time_limit_s=60, warmup=1, progress=False)
    sweep = sweep_http(f"http://{http.address}", [4.0], config)
    (report,) = asyncio.run_coroutine_threadsafe(sweep, loop).result(timeout=120)
    assert [(r.error, r.finish_reason) for r in report.requests] == [("", "length")] * 3
    assert all(r.completed and r.token_times_s[0] > 0 for r in report.requests)
    assert report.summary.completed == 3


def test_conversations_send_back_the_servers_answers(server, model_path):
    """bench.prefix_reuse's chat trace over the OpenAI front: each turn sends the previous
    prompt, the answer this server streamed, then the next message; every turn is a record,
    and the turns after the first reuse the history from the prefix cache."""
    import httpx

    from bench.loadgen import HTTPTarget
    from bench.prefix_reuse import TURN_STRIDE, ChatTrace, later_turns, run_conversations

    _, loop, http = server
    trace = ChatTrace(2, (3, 3), system_tokens=300, first_tokens=40, question_tokens=20, output_tokens=8, think_s=0)
    config = LoadConfig(num_requests=1, time_limit_s=120, warmup=0, progress=False)
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    async def run() -> RunReport:
        async with httpx.AsyncClient(event_hooks={"request": [record]}) as client:
            target = HTTPTarget(client, f"http://{http.address}", "loadgen")
            return await run_conversations(target, trace, 4.0, config, "chat", model_path)

    report = asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=240)
    by_index = {r.index: r for r in report.requests}
    assert sorted(by_index) == [c * TURN_STRIDE + t for c in range(2) for t in range(3)]
    assert all(r.completed and r.text for r in report.requests)
    prompts = {body["request_id"].rsplit("-", 1)[1]: body["prompt"] for body in sent}
    for c in range(2):
        for t in (1, 2):
            earlier, answer = prompts[str(c * TURN_STRIDE + t - 1)], by_index[c * TURN_STRIDE + t - 1].text
            assert prompts[str(c * TURN_STRIDE + t)].startswith(earlier + answer)
            assert by_index[c * TURN_STRIDE + t].cached_tokens >= 256  # at least the system prompt's block
    assert later_turns(report).p50 is not None and report.summary.completed == 6


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_router_and_load_generator_share_one_percentile_definition():
    """A stream's final message (as the router encodes it) and the load generator's report
    give the same p50/p90/p99 of the same token gaps."""
    from messages.results import GenerationResult
    from router.convert import encode_final
    from router.orchestrator import _timings

    gaps = [0.010, 0.012, 0.011, 0.250, 0.009, 0.013, 0.010, 0.011, 0.014, 0.012, 0.090]
    times = [0.1 + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    result = GenerationResult("length", 4, len(times), _timings(0.0, None, 0.0, times), "", "decode-0")
    final = encode_final("r", result).final.timings.inter_token
    record = RequestRecord(0, 4, len(times), 0.0, 0.0, tuple(times), times[-1], "length", "")
    client = summarize([record], DEFAULT_SLO).itl_s
    assert (final.p50_s, final.p90_s, final.p99_s) == pytest.approx((client.p50, client.p90, client.p99), abs=1e-12)
    assert client.p99 == pytest.approx(0.2340)  # interpolated, not nearest-rank (0.250)
