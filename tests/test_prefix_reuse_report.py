"""bench/prefix_reuse.py's report: ratios taken within each round of `--rounds`, the median first."""

from bench.loadgen import RequestRecord, RunReport, summarize
from bench.prefix_reuse import SERVED_SYSTEMS, _print_ratios, turns
from messages.timings import SLO

SLO_ = SLO(1.0, 0.05)


def _report(label: str, rate: float, ttft_s: float) -> RunReport:
    """Four requests one second apart, each with this TTFT and two more tokens 10 ms apart."""
    times = (ttft_s, ttft_s + 0.01, ttft_s + 0.02)
    records = [RequestRecord(i, 100, 3, float(i), float(i), times, times[-1], "length", "") for i in range(4)]
    return RunReport(f"{label} {rate:g} req/s", rate, SLO_, summarize(records, SLO_), records)  # as run_served labels


def test_ratios_are_taken_within_each_round_and_their_median_comes_first(capsys):
    chosen = {key: SERVED_SYSTEMS[key] for key in ("aware", "blind", "smg-aware", "smg-rr")}
    aware, blind, smg_aware, smg_rr = (served.label for served in chosen.values())
    # Round 2 runs every system twice as slow (the box drifted): its ratios are round 1's.
    ttfts = {aware: 0.030, blind: 0.060, smg_aware: 0.040, smg_rr: 0.050}
    rounds = [{label: [_report(label, 4.0, t * slow)] for label, t in ttfts.items()} for slow in (1, 2, 1)]
    rounds[2][aware] = [_report(aware, 4.0, 0.045)]  # round 3: aware alone slower
    _print_ratios(rounds, chosen, "req/s")
    out = capsys.readouterr().out
    assert "/ cache-blind 0.50x (rounds 0.50, 0.50, 0.75)" in out
    assert f"/ best stock ({smg_aware}) 0.75x (rounds 0.75, 0.75, 1.12)" in out
    assert f"{aware}: >= 90% in SLO at 4 req/s / 4 req/s / 4 req/s (per round)" in out


def test_one_round_reports_plain_ratios(capsys):
    chosen = {key: SERVED_SYSTEMS[key] for key in ("aware", "smg-rr")}
    aware, smg_rr = (served.label for served in chosen.values())
    _print_ratios([{aware: [_report(aware, 2.0, 0.03)], smg_rr: [_report(smg_rr, 2.0, 0.06)]}], chosen, "req/s")
    out = capsys.readouterr().out
    assert f"/ best stock ({smg_rr}) 0.50x (target <= 1.0)" in out and "rounds" not in out


def test_a_best_stock_setup_that_changes_between_rounds_is_said_so(capsys):
    chosen = {key: SERVED_SYSTEMS[key] for key in ("aware", "smg-aware", "smg-rr")}
    aware, smg_aware, smg_rr = (served.label for served in chosen.values())
    rounds = [
        {aware: [_report(aware, 2.0, 0.03)], smg_aware: [_report(smg_aware, 2.0, a)], smg_rr: [_report(smg_rr, 2.0, r)]}
        for a, r in ((0.04, 0.06), (0.06, 0.04))
    ]
    _print_ratios(rounds, chosen, "req/s")
    assert "/ best stock (the faster in each round) 0.75x (rounds 0.75, 0.75)" in capsys.readouterr().out


def test_every_other_round_runs_the_systems_in_reverse():
    systems = [SERVED_SYSTEMS[key] for key in ("aware", "aware-1p1d", "smg-aware")]
    assert turns(systems, 1) == systems
    assert turns(systems, 2) == systems[::-1]
    assert turns(systems, 3) == systems


def test_a_system_run_alone_gets_no_empty_ratio_line(capsys):
    chosen = {"aware": SERVED_SYSTEMS["aware"]}
    aware = chosen["aware"].label
    _print_ratios([{aware: [_report(aware, 2.0, 0.03)]}], chosen, "req/s")
    out = capsys.readouterr().out
    assert "TTFT p50" not in out
    assert f"{aware}: >= 90% in SLO at 2 req/s" in out


def test_strict_slo_goodput_is_read_at_stock_highest_rate_kept_and_as_distserve_counts(capsys):
    chosen = {key: SERVED_SYSTEMS[key] for key in ("aware", "smg-aware", "smg-rr")}
    aware, smg_aware, smg_rr = (served.label for served in chosen.values())
    # Stock keeps the SLO to 4 req/s (cache_aware) and 2 (round robin); pdserve to 8, the highest run.
    kept_to = {aware: 8.0, smg_aware: 4.0, smg_rr: 2.0}
    series = {
        label: [_report(label, rate, 0.03 if rate <= top else 2.0) for rate in (2.0, 4.0, 8.0)]
        for label, top in kept_to.items()
    }
    _print_ratios([series], chosen, "req/s")
    out = capsys.readouterr().out
    assert f"{aware} at 4 req/s, the best stock setup's highest rate >= 90% in SLO: goodput / stock's 1.00x" in out
    assert "(DistServe's goodput; +: its highest rate run): 2.00x+" in out
    assert "goodput / the best stock goodput infx" in out  # at 8 req/s stock kept none


def test_no_strict_slo_ratio_without_a_stock_rate_in_slo(capsys):
    chosen = {key: SERVED_SYSTEMS[key] for key in ("aware", "smg-rr")}
    aware, smg_rr = (served.label for served in chosen.values())
    _print_ratios([{aware: [_report(aware, 2.0, 0.03)], smg_rr: [_report(smg_rr, 2.0, 2.0)]}], chosen, "req/s")
    assert f"{aware}: no stock setup kept >= 90% in SLO at any rate run" in capsys.readouterr().out


def test_engines_size_the_systems_without_a_prefill_pool_and_their_labels_say_so():
    aware, stock, pd = (SERVED_SYSTEMS[key].with_pool(4) for key in ("aware", "smg-aware", "aware-1p1d"))
    assert (aware.decode, aware.label) == (4, "pdserve colocated x4, cache-aware")
    assert (stock.decode, stock.label) == (4, "stock vLLM x4, SMG cache_aware")
    assert (pd.prefill, pd.decode, pd.label) == (1, 1, SERVED_SYSTEMS["aware-1p1d"].label)


def test_a_baseline_trees_twin_is_compared_with_its_system_within_each_round(capsys):
    from pathlib import Path

    aware = SERVED_SYSTEMS["aware-1p1d"]
    chosen = {"aware-1p1d": aware, "aware-1p1d@baseline": aware.from_tree(Path("/tmp/base"))}
    new, base = aware.label, chosen["aware-1p1d@baseline"].label
    assert base == f"{new} (code from /tmp/base)" and chosen["aware-1p1d@baseline"].tree == Path("/tmp/base")
    rounds = [{new: [_report(new, 1.0, n)], base: [_report(base, 1.0, b)]} for n, b in ((0.045, 0.050), (0.09, 0.1))]
    _print_ratios(rounds, chosen, "req/s")
    out = capsys.readouterr().out
    assert f"{new} at 1 req/s: TTFT / the baseline tree's: p50 0.90x (rounds 0.90, 0.90), p90 0.90x" in out


def test_the_routers_readings_give_a_runs_prediction_share_and_mean_queue_phase():
    from bench.prefix_reuse import RouterCounters, RouterShare

    before = RouterCounters({"within 5%": 10.0, "over": 2.0}, queue_s=1.0, queued=12.0)
    after = RouterCounters({"within 5%": 28.0, "over": 4.0}, queue_s=1.2, queued=52.0)
    share = after.since(before)
    assert share.index_within_5pct == 0.9 and abs(share.queue_ms - 5.0) < 1e-9
    assert after.since(None) == RouterShare()  # a stock system: no router to read
