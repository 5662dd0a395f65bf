"""Text prompts to token ids for the gRPC front, which needs nothing else of a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def prompt_encoder(model: str) -> Callable[[str], list[int]]:
    """Text to token ids as transformers' fast tokenizer gives them, from the Rust `tokenizers`
    one it wraps: without importing transformers and torch, most of a router's start time."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():  # a slow-only tokenizer: transformers converts it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model).encode
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: tokenizer.encode(text).ids
