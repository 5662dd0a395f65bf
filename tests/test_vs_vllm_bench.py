"""bench/vs_vllm.py's judging of `vllm bench serve` records (the servers run in `make bench`)."""

import sys
from pathlib import Path

import pytest

from bench.vs_vllm import DEFAULT_SLO, _System, judge, records_of


def _data(requests: list[tuple[float, list[float], int, str]]) -> dict:
    """(ttft, gaps, output tokens, error) per request, started 1 s apart, as the benchmark saves them."""
    return {
        "ttfts": [r[0] for r in requests],
        "itls": [r[1] for r in requests],
        "start_times": [float(i) for i in range(len(requests))],
        "latencies": [r[0] + sum(r[1]) for r in requests],
        "output_lens": [r[2] for r in requests],
        "errors": [r[3] for r in requests],
    }


def test_a_closing_chunk_without_a_token_is_not_a_gap():
    (record,) = records_of(_data([(0.1, [0.01, 0.01, 0.0001], 3, "")]))
    assert record["itl"] == [0.01, 0.01]


def test_requests_are_judged_by_ttft_and_their_p90_gap():
    fast, slow_start = (0.2, [0.01] * 9, 10, ""), (1.5, [0.01] * 9, 10, "")
    stuttering = (0.2, [0.01] * 7 + [0.2] * 2, 10, "")
    short, failed = (0.2, [0.01] * 4, 5, ""), (0.0, [], 0, "HTTP 503")
    point = judge("s", 1.0, records_of(_data([fast, slow_start, stuttering, short, failed])), 10, DEFAULT_SLO)
    assert (point.sent, point.completed) == (5, 3)
    assert point.slo_attainment == pytest.approx(1 / 5)  # only `fast` meets both bounds
    assert point.tpot_s.p50 == pytest.approx(0.01)


def test_goodput_over_several_turns_counts_only_the_time_each_turn_ran():
    # Two turns of the same system, 100 s apart (the other systems ran in between): goodput
    # is good requests over the two turns' own spans, not over the whole interval.
    first = [{**r, "turn": 1} for r in records_of(_data([(0.1, [0.01] * 9, 10, "")] * 5))]
    second = [{**r, "turn": 2, "start": r["start"] + 100, "end": r["end"] + 100} for r in first]
    point = judge("s", 1.0, first + second, 10, DEFAULT_SLO)
    span = first[-1]["end"] - first[0]["start"]  # each turn: 5 requests, 1 s apart
    assert point.goodput_rps == pytest.approx(10 / (2 * span))
    assert point.slo_attainment == 1.0


def test_judged_points_plot_to_a_png(tmp_path):
    from bench.vs_vllm import plot

    points = [
        judge(system, rate, records_of(_data([(0.1, [gap] * 9, 10, "")] * 3)), 10, DEFAULT_SLO)
        for system, gap in (("stock", 0.02), ("pdserve", 0.01))
        for rate in (1.0, 3.0)
    ]
    path = tmp_path / "vs.png"
    plot(points, ["stock", "pdserve"], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_system_from_another_checkout_imports_every_package_from_it(tmp_path: Path):
    # The installed checkout's .pth imports vllm_engine as each interpreter starts: an A/B
    # against another tree must still load that tree's vllm_engine, not the installed one.
    package = tmp_path / "vllm_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "torchvision_shim.py").write_text("def install():\n    pass\n")
    probe = [sys.executable, "-c", "import vllm_engine; print('loaded', vllm_engine.__file__)"]
    system = _System("probe", [(probe, {}, "http://127.0.0.1:1")], cwd=tmp_path)
    system._servers[0].wait(60)
    system.stop()
    assert f"loaded {package / '__init__.py'}" in Path(system._log.name).read_text()
