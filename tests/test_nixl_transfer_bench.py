"""The NIXL transfer benchmark moves the Qwen3.5-27B hybrid layout intact between processes."""

from __future__ import annotations

import pytest

from bench.nixl_transfer import TRANSPORTS, BenchConfig, HybridLayout, measure

KiB = 1024
MiB = 1024 * KiB


def test_layout_matches_qwen35_27b_shapes() -> None:
    layout = HybridLayout()
    assert layout.block_bytes == 64 * KiB  # 16 tokens x 4 KiB per layer
    assert layout.attention_bytes(32768) == 2048 * MiB  # 32k tokens x 64 KiB
    assert layout.conv_state_bytes == 60 * KiB
    assert layout.temporal_state_bytes == 3 * MiB
    assert layout.state_bytes == 48 * (3 * MiB + 60 * KiB)
    assert layout.descriptors(32768) == 16 * 2048 + 2 * 48


@pytest.mark.timeout(180)
def test_pull_between_processes_is_intact_and_accounted() -> None:
    lengths = (1024, 2048)
    report = measure(BenchConfig(lengths=lengths, reps=1, transports=(TRANSPORTS["default"],)))

    assert [(r.transport, r.prompt_tokens) for r in report.rows] == [("default", n) for n in lengths]
    for row in report.rows:
        tokens = row.prompt_tokens
        # Bytes are summed from the descriptors the consumer actually posted.
        assert row.attention_kv_bytes == tokens * 64 * KiB
        assert row.deltanet_state_bytes == 48 * (3 * MiB + 60 * KiB)
        assert row.descriptors == 16 * (tokens // 16) + 2 * 48
        assert row.intact
        assert row.reps == 1
        assert row.gib_per_s > 0 and row.copy_gib_per_s > 0
    assert report.target_met is None  # 32k tokens not measured here


@pytest.mark.timeout(180)
def test_pull_across_a_veth_link_between_namespaces_is_intact() -> None:
    """`veth-tcp`: producer and consumer each in a network namespace of its own, joined by a
    veth pair, so the READ crosses a link between two network stacks; the namespaces go after."""
    import subprocess

    report = measure(BenchConfig(lengths=(1024,), reps=1, transports=(TRANSPORTS["veth-tcp"],)))
    (row,) = report.rows
    assert row.transport == "veth-tcp" and row.intact and row.gib_per_s > 0
    assert row.attention_kv_bytes == 1024 * 64 * KiB
    assert "pdbench-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
