"""bench.prefix_reuse replays traces in Mooncake's format: rows sharing a hash id share that
block's tokens, prompts are cut to their input length, arrivals keep the trace's pattern at
the asked rate (a fast test: no engine)."""

from __future__ import annotations

import json

import pytest

from bench.prefix_reuse import MooncakeTrace

ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 20, "hash_ids": [7, 8, 9]},
    {"timestamp": 1500, "input_length": 700, "output_length": 30, "hash_ids": [7, 10]},
    {"timestamp": 3000, "input_length": 512, "output_length": 5, "hash_ids": [11]},
]


def test_shared_hash_ids_share_tokens_and_arrivals_keep_their_pattern(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    specs, prompts = MooncakeTrace(path).requests(rate=3.0, count=10)
    assert [len(p) for p in prompts] == [s.prompt_tokens for s in specs] == [1100, 700, 512]
    assert [s.output_tokens for s in specs] == [20, 30, 5]
    assert prompts[0][:512] == prompts[1][:512]  # hash id 7
    assert prompts[0][512:700] != prompts[1][512:700]  # 8 and 10 differ
    assert prompts[2][:512] not in (prompts[0][:512], prompts[1][:512])
    # 3 rows over 2 s is 1.5 req/s: at 3 req/s the gaps halve, their ratio stays.
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.25, 1.0])
    assert MooncakeTrace(path, seed=1).requests(3.0, 10)[1][0] != prompts[0]  # seeded
    assert MooncakeTrace(path).requests(3.0, 10)[1] == prompts  # reproducibly
    assert MooncakeTrace(path).requests(2.0, 10)[1][0] != prompts[0]  # another rate's run shares nothing
    too_long = tmp_path / "bad.jsonl"
    too_long.write_text(json.dumps({**ROWS[2], "input_length": 600}) + "\n" + json.dumps(ROWS[2]) + "\n")
    with pytest.raises(ValueError, match="row 0 has 600 input tokens"):
        MooncakeTrace(too_long).requests(1.0, 10)


def test_a_scaled_replay_keeps_who_shares_what(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    full = MooncakeTrace(path).requests(rate=3.0, count=10)[1]
    specs, prompts = MooncakeTrace(path, replay_block_tokens=128, max_blocks=2, max_output_tokens=25).requests(
        rate=3.0, count=10
    )
    # 1100 tokens over 512-token blocks is 275 over 128-token ones, cut to two blocks: 256.
    assert [len(p) for p in prompts] == [s.prompt_tokens for s in specs] == [256, 175, 128]
    assert [s.output_tokens for s in specs] == [20, 25, 5]
    assert prompts[0][:128] == prompts[1][:128] == full[0][:128]  # hash id 7, shared and scaled alike
    assert prompts[0][128:175] != prompts[1][128:175]
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.25, 1.0])
    with pytest.raises(ValueError, match="max_blocks must be >= 1"):
        MooncakeTrace(path, max_blocks=0)


def test_rows_sharing_a_rounded_timestamp_are_spread_to_the_next_one(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{**ROWS[2], "timestamp": t} for t in (0, 0, 0, 3000, 6000, 6000)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    # The last pair spreads over the 3 s gap before it: 6 rows over 7.5 s, so 0.8 req/s is the trace's own pace.
    spread = MooncakeTrace(path).requests(rate=0.8, count=10)[0]
    assert [s.arrival_s for s in spread] == pytest.approx([0.0, 1.0, 2.0, 3.0, 6.0, 7.5])
    stamped = MooncakeTrace(path, spread_ties=False).requests(rate=1.0, count=10)[0]
    assert [s.arrival_s for s in stamped] == pytest.approx([0.0, 0.0, 0.0, 3.0, 6.0, 6.0])
