"""The configuration tree: flags and docs generated from it, defaults kept in one place,
every config refusing a bad value by naming its field."""

import argparse
import dataclasses
from pathlib import Path

import pytest

from cli.config import COMMANDS, ServeConfig, configuration_reference
from cli.main import main
from configuration.fields import HELP, TITLE
from configuration.flags import add_flags, build, tree_flags

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
        (["--nixl-progress-poll-us", "10"], "nixl_progress_poll_us"),
        (["--routers", "0"], "routers"),
        (["--max-engines-per-pool", "0"], "max_pool_size"),
        (["--tls-key", "k.pem"], "--tls-cert"),
        (["--prefill-tp", "2", "--decode-tp", "3"], "prefill TP 2 cannot hand off to decode TP 3"),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(flags, named):
    with pytest.raises(ValueError, match=named):
        parse(*flags)


@pytest.mark.parametrize("flags", [["--listen", "0.0.0.0:50051"], ["--http", "198.18.0.1:8000"], ["--listen", "myhost:1"]])
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
