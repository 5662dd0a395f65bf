"""The embedded default model: a tiny Qwen3.5-architecture hybrid built locally."""

from vllm_engine.embedded_model.build import EmbeddedModelSpec, ensure_embedded_model

__all__ = ["EmbeddedModelSpec", "ensure_embedded_model"]
