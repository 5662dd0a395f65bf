"""The cluster probe measures real engines and writes what the tuner reads."""

import json
from dataclasses import asdict

from conftest import run

from cli.probe import ProbeConfig, ProbeResult, run_probe


def test_knee_is_where_decode_throughput_stops_scaling():
    result = ProbeResult("test", "m")
    for batch, step in [(1, 0.010), (2, 0.010), (4, 0.011), (8, 0.012), (16, 0.022), (32, 0.044)]:
        result.decode.append({"batch_size": batch, "context_tokens": 100, "step_seconds": step})
    assert result.decode_knee() == 8
    assert result.decode_tokens_per_s(1) == 100


def test_probe_measures_prefill_decode_and_transfer(ray_cluster, model_path, tmp_path):
    config = ProbeConfig(
        model=model_path,
        prompt_lengths=(64, 512),
        prefill_batches=(1, 2),
        decode_batches=(1, 4),
        decode_steps=24,
        transfer_lengths=(128, 1024),
        transfer_repeats=1,
    )
    result = run(run_probe(config))
    assert len(result.prefill) == 4 and all(p["seconds"] > 0 for p in result.prefill)
    # Measured, not compared: on a box shared with another test run's engines, batch 4 once
    # decoded 29.8 tokens/s against batch 1's 41.3 (the knee's arithmetic is tested above).
    assert [d["batch_size"] for d in result.decode] == [1, 4] and all(d["step_seconds"] > 0 for d in result.decode)
    assert result.prefill_tokens_per_s() > 0
    assert result.transfer[0]["bytes"] < result.transfer[1]["bytes"]
    assert result.layout["deltanet_state_bytes_per_request"] > 0
    # Sent through gRPC: the client waits for the engines' work and then some (the path's cost).
    assert [s["prompt_tokens"] for s in result.serving] == [128, 1024]
    assert all(s["client_ttft_s"] > s["engine_s"] > 0 for s in result.serving)
    # CPU engines: the rest of the host's busy time was measured while tokens streamed.
    assert result.host_cpu["engine_cores"] == 2
    assert [r["tokens_per_s"] > 0 and r["busy_cores"] > 0 for r in result.host_cpu["rows"]] == [True, True]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(asdict(result)))
    assert set(json.loads(path.read_text())) == {
        "hardware",
        "model",
        "prefill",
        "decode",
        "transfer",
        "layout",
        "serving",
        "host_cpu",
        "engines",
    }
    assert result.engines == {"device": "cpu", "prefill_tp": 1, "decode_tp": 1}
