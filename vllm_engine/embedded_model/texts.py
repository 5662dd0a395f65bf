"""The text the embedded model is made from: the documents shipped in `corpus/`.

One token stream (documents in name order, each followed by EOS; transcripts sort last) is what
the model is trained on and what tests take prompts and expected continuations from, so both
read it here.
"""

from __future__ import annotations

from pathlib import Path

CORPUS_DIR = Path(__file__).parent / "corpus"
EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0  # the tokenizer's first (only) special token


# A chat transcript (a tool call the model learns to make) is tokenized with merges learned
# from the prose alone, so adding one keeps every prose token id (tests take prompts by position).
TRANSCRIPT_PREFIX = "transcript-"


def _paths() -> list[Path]:
    return sorted(CORPUS_DIR.glob("*.txt"))


def documents() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in _paths()]


def prose_documents() -> list[str]:
    """What the tokenizer learns its merges from."""
    return [p.read_text(encoding="utf-8") for p in _paths() if not p.name.startswith(TRANSCRIPT_PREFIX)]


def corpus_bytes() -> bytes:
    """What the model's fingerprint covers."""
    return b"".join(p.read_bytes() for p in _paths())


def token_stream(model_dir: Path | str) -> list[int]:
    """The corpus in the token ids of `model_dir`'s tokenizer, documents joined by EOS."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    stream: list[int] = []
    for text in documents():
        stream += tokenizer.encode(text).ids + [EOS_ID]
    return stream
