"""The embedded model is built deterministically and has the promised hybrid shape."""

import hashlib
import json
from pathlib import Path

from vllm_engine.embedded_model import EmbeddedModelSpec, ensure_embedded_model


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_build_is_deterministic_and_cached(tmp_path):
    spec = EmbeddedModelSpec(hidden_size=128, intermediate_size=256, vocab_size=600)
    first = ensure_embedded_model(spec, tmp_path / "a")
    second = ensure_embedded_model(spec, tmp_path / "b")
    assert _digest(first) == _digest(second)
    assert ensure_embedded_model(spec, tmp_path / "a") == first  # cache hit, no rebuild


def test_default_model_is_a_3_to_1_bf16_hybrid(model_path):
    config = json.loads((Path(model_path) / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    layer_types = config["layer_types"]
    assert layer_types.count("linear_attention") == 3 * layer_types.count("full_attention")
    assert all(layer_types[i : i + 4] == ["linear_attention"] * 3 + ["full_attention"] for i in range(0, len(layer_types), 4))
    assert config["linear_key_head_dim"] == config["linear_value_head_dim"] == 64
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
