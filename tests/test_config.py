"""The configuration tree: flags and docs generated from it, defaults kept in one place,
every config refusing a bad value by naming its field."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from cli.config import COMMANDS, ServeConfig, configuration_reference
from cli.main import main
from cli.probe import ProbeConfig
from configuration.fields import HELP, TITLE
from configuration.flags import add_flags, build, tree_flags
from messages.timings import SLO
from planner.search import SearchSpace
from planner.simulator import WorkloadConfig
from vllm_engine.plan_cli import PLAN_IGNORES, PlanConfig

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def parse(*flags: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    add_flags(parser, ServeConfig)
    return build(ServeConfig, parser.parse_args(list(flags)))


def configs_in(cls: type) -> set[type]:
    """Every dataclass of the tree rooted at `cls`."""
    import typing

    found = {cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if TITLE in f.metadata:
            inner = next(a for a in (*typing.get_args(hints[f.name]), hints[f.name]) if dataclasses.is_dataclass(a))
            found |= configs_in(inner)
    return found


def test_the_configuration_reference_is_current():
    assert DOCS.read_text() == configuration_reference(), "regenerate it: python -m cli.config > docs/configuration.md"


def test_every_field_of_every_config_is_a_knob_or_a_section_and_every_config_is_frozen_and_slotted():
    for command, (tree, _) in COMMANDS.items():
        for cls in configs_in(tree):
            params = cls.__dataclass_params__
            assert params.frozen and hasattr(cls, "__slots__"), f"{cls.__name__} must be frozen and slotted"
            bare = [f.name for f in dataclasses.fields(cls) if HELP not in f.metadata]
            assert not bare, f"{command}: {cls.__name__} fields without help/flag metadata: {bare}"


def test_flag_names_are_unique_per_command():
    for command, (tree, _) in COMMANDS.items():
        names = [flag.name for flag in tree_flags(tree)]
        assert len(names) == len(set(names)), (command, sorted(n for n in names if names.count(n) > 1))


def test_no_flag_given_keeps_every_dataclass_default(monkeypatch):
    monkeypatch.delenv("PDSERVE_TOKENS", raising=False)
    assert parse() == ServeConfig()


def test_flags_reach_the_fields_they_name():
    config = parse(
        "--prefill", "2", "--decode-max-num-seqs", "4", "--max-num-seqs", "8", "--lease", "10",
        "--kv-cache-bytes", "512MiB", "--backends", "UCX", "POSIX", "--no-enforce-eager",
        "--local-prefill-below", "64", "--max-migrations", "0", "--http", "127.0.0.1:8000",
        "--nixl-progress-poll-us", "none", "--extra-engine-args", '{"swap_space": 0}',
    )  # fmt: skip
    dep = config.deployment
    assert (dep.num_prefill, dep.decode_sizing.max_num_seqs, dep.engine.max_num_seqs) == (2, 4, 8)
    assert dep.role_engine("decode").max_num_seqs == 4 and dep.role_engine("prefill").max_num_seqs == 8
    assert dep.transfer.lease_s == 10 and dep.transfer.backends == ("UCX", "POSIX")
    assert dep.transfer.nixl_progress_poll_us is None and dep.engine.extra_engine_args == {"swap_space": 0}
    assert dep.engine.kv_cache_bytes == 512 << 20 and dep.engine.enforce_eager is False
    assert config.router.policy.local_prefill_below == 64 and config.router.policy.max_migrations == 0
    assert dep.policy == config.router.policy, "in-process and router policies are one"
    assert config.router.http == "127.0.0.1:8000" and config.router.model == dep.engine.model


def test_kv_buffers_follow_the_engines_device():
    assert parse("--device", "cuda").deployment.transfer.kv_buffer_device == "cuda"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--lease", "0"], "lease_s"),
        (["--lease", "5", "--handle-margin-s", "5"], "handle_margin_s"),
        (["--decode", "0"], "num_decode"),
        (["--decode-max-num-seqs", "0"], "max_num_seqs"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
        (["--local-prefill-below", "1"], "local_prefill_below"),
        (["--local-prefill-uncached", "-1"], "local_prefill_uncached"),
        (["--nixl-progress-poll-us", "10"], "nixl_progress_poll_us"),
        (["--routers", "0"], "routers"),
        (["--start-timeout-s", "0"], "start_timeout_s"),
        (["--max-engines-per-pool", "0"], "max_pool_size"),
        (["--tls-key", "k.pem"], "--tls-cert"),
        (["--prefill-tp", "2", "--decode-tp", "3"], "prefill TP 2 cannot hand off to decode TP 3"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(flags, named):
    with pytest.raises(ValueError, match=named):
        parse(*flags)


@pytest.mark.parametrize(
    "flags", [["--listen", "0.0.0.0:50051"], ["--http", "198.18.0.1:8000"], ["--listen", "myhost:1"]]
)
def test_a_front_door_beyond_loopback_needs_tokens_or_an_explicit_yes(flags, monkeypatch, tmp_path):
    monkeypatch.delenv("PDSERVE_TOKENS", raising=False)
    with pytest.raises(ValueError, match="not loopback and no tokens"):
        parse(*flags)
    assert parse(*flags, "--allow-unauthenticated").allow_unauthenticated
    tokens = tmp_path / "tokens"
    tokens.write_text("generate:" + "t" * 16)
    assert parse(*flags, "--tokens-file", str(tokens)).router.front.tokens is not None
    assert parse("--listen", "[::1]:50051", "--http", "localhost:8000").router.front.tokens is None


def test_serve_refuses_a_bad_value_before_anything_starts(capsys):
    assert main(["serve", "--lease", "0"]) == 2
    assert "lease_s must be >= 1" in capsys.readouterr().err


def test_a_value_of_the_wrong_type_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-bytes", "lots"])
    assert "--kv-cache-bytes" in capsys.readouterr().err


# --- plan, probe, tune: the same tree machinery, each tool's own root -------------------

TUNE_NEEDS = ("--seeds-example", "--gpus", "8", "--ttft-slo", "2", "--itl-slo", "0.1")


def parse_as(command: str, *flags: str):
    """The config `pdserve <command>` builds from these flags (with that command's skips)."""
    tree, skip = COMMANDS[command]
    parser = argparse.ArgumentParser()
    add_flags(parser, tree, skip)
    return build(tree, parser.parse_args(list(flags)))


def test_plan_flags_reach_the_engines_they_size():
    config = parse_as(
        "plan", "--config", "c.json", "--device", "cuda", "--prefill-tp", "4", "--decode-tp", "2",
        "--decode-max-num-seqs", "128", "--max-model-len", "32768", "--gpu-memory-gib", "141", "--context", "4096",
    )  # fmt: skip
    prefill, decode = config.role_engine("prefill"), config.role_engine("decode")
    assert config.config == "c.json" and prefill.device == decode.device == "cuda"
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (4, 2)
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (16, 128) and decode.max_model_len == 32768
    assert (config.gpu_memory_gib, config.context, config.prompt_tokens) == (141.0, 4096, 2000)
    assert parse_as("plan") == PlanConfig(), "no flag given keeps every dataclass default"


def test_plan_leaves_out_the_engine_flags_a_plan_ignores():
    with pytest.raises(SystemExit):
        parse_as("plan", "--seed", "1")
    assert {"seed", "max-num-batched-tokens"} <= PLAN_IGNORES


def test_probe_flags_reach_the_fields_they_name():
    config = parse_as(
        "probe", "--address", "head:6379", "--device", "cuda", "--prefill-tp", "2", "--decode-tp", "4",
        "--prompt-lengths", "64", "512", "--decode-batches", "1", "8", "--decode-steps", "24", "--out", "p.json",
    )  # fmt: skip
    assert (config.address, config.device, config.prefill_tp, config.decode_tp) == ("head:6379", "cuda", 2, 4)
    assert config.prompt_lengths == (64, 512) and config.decode_batches == (1, 8) and config.decode_steps == 24
    assert config.out == "p.json" and config.transfer_repeats == ProbeConfig().transfer_repeats
    assert parse_as("probe") == ProbeConfig()


def test_tune_flags_reach_the_space_slo_and_workload():
    config = parse_as(
        "tune", *TUNE_NEEDS, "--gpus-per-instance", "4", "--percentile", "99", "--batch-limits", "32", "64",
        "--no-colocated", "--length-shape", "lognormal", "--requests", "50", "--trace", "t.jsonl", "--apply", "h:1",
    )  # fmt: skip
    assert config.seeds_example and config.probe is None and config.apply == "h:1"
    assert config.space == SearchSpace(8, 4, (32, 64), include_colocated=False)
    assert config.slo == SLO(2.0, 0.1, 99.0)
    workload = config.workload
    assert (workload.length_shape, workload.requests, workload.trace) == ("lognormal", 50, "t.jsonl")
    assert parse_as("tune", *TUNE_NEEDS).workload == WorkloadConfig()
    with pytest.raises(SystemExit):  # the simulator judges mean inter-token times only
        parse_as("tune", *TUNE_NEEDS, "--itl-stat", "p90")


@pytest.mark.parametrize(
    "command, flags, named",
    [
        ("plan", ["--gpu-memory-gib", "0"], "gpu_memory_gib"),
        ("plan", ["--config", "c.json", "--model", "/models/m"], "config"),
        ("plan", ["--context", "0"], "context"),
        ("plan", ["--decode-max-num-seqs", "0"], "max_num_seqs"),
        ("probe", ["--decode-steps", "9"], "decode_steps"),
        ("probe", ["--prompt-lengths", "0", "64"], "prompt_lengths"),
        ("probe", ["--transfer-repeats", "0"], "transfer_repeats"),
        ("probe", ["--prefill-tp", "2", "--decode-tp", "3"], "prefill TP 2 cannot hand off to decode TP 3"),
        ("tune", [*TUNE_NEEDS, "--probe", "p.json"], "probe, model, seeds_example"),
        ("tune", [*TUNE_NEEDS, "--gpus-per-instance", "3"], "gpus_per_instance"),
        ("tune", [*TUNE_NEEDS, "--batch-limits", "0"], "batch_limits"),
        ("tune", [*TUNE_NEEDS, "--percentile", "120"], "percentile"),
        ("tune", [*TUNE_NEEDS, "--ttft-slo", "0"], "ttft_s"),
        ("tune", [*TUNE_NEEDS, "--length-spread", "2"], "length_spread"),
        ("tune", [*TUNE_NEEDS, "--requests", "0"], "requests"),
        ("tune", [*TUNE_NEEDS, "--rate", "-1"], "rate"),
    ],
)
def test_a_bad_plan_probe_or_tune_value_is_refused_naming_its_field(command, flags, named):
    with pytest.raises(ValueError, match=named):
        parse_as(command, *flags)


def test_plan_refuses_a_bad_value_with_exit_2(capsys):
    assert main(["plan", "--gpu-memory-gib", "0"]) == 2
    assert "gpu_memory_gib must be > 0" in capsys.readouterr().err


def test_tune_says_which_required_flags_are_missing(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--seeds-example", "--ttft-slo", "2"])
    err = capsys.readouterr().err
    assert "--gpus" in err and "--itl-slo" in err


def test_tune_refuses_an_instance_size_the_figures_are_not_for(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["tune", *TUNE_NEEDS, "--gpus-per-instance", "2", "--out", str(tmp_path / "t.json")])
    assert "gpus_per_instance 2, but the figures are for TP 4 engines" in capsys.readouterr().err


def test_required_flags_are_marked_in_help_and_docs():
    flags = {flag.name: flag for flag in tree_flags(COMMANDS["tune"][0])}
    assert flags["gpus"].required and flags["ttft-slo"].shown_default == "required"
    assert not flags["gpus-per-instance"].required
    serve = {flag.name: flag for flag in tree_flags(ServeConfig)}
    assert not serve["tls-cert"].required, "needed only with the other --tls-* flags"


def test_serve_derives_the_local_prefill_limit_from_the_planner_model(tmp_path, capsys):
    """Unset, conditional disaggregation takes the break-even of the planner model's costs
    (and says so); without a model it is off; a given value stays."""
    from cli.main import _with_local_prefill_limit
    from planner.model import PerformanceModel

    model = tmp_path / "model.json"
    PerformanceModel.seeds_example().save(model)
    derived = _with_local_prefill_limit(parse("--planner-model", str(model)))
    assert derived.router.policy.local_prefill_uncached == 23
    assert derived.deployment.policy.local_prefill_uncached == 23  # the one policy
    assert "lacks at most 23 prompt tokens" in capsys.readouterr().err
    assert _with_local_prefill_limit(parse()).router.policy.local_prefill_uncached == 0
    assert "off: no --planner-model" in capsys.readouterr().err
    given = _with_local_prefill_limit(parse("--local-prefill-uncached", "7", "--planner-model", str(model)))
    assert given.router.policy.local_prefill_uncached == 7
    colocated = _with_local_prefill_limit(parse("--prefill", "0"))
    assert colocated.router.policy.local_prefill_uncached is None  # no handoff to save
