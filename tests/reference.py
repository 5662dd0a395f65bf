"""Prompts and colocated reference outputs that disaggregated runs are compared against."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Iterator, Mapping

from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult

MAX_TOKENS = 80
# bf16 greedy decoding: where the reference's top two candidates are closer than this,
# batch shape alone can flip the choice. Compare up to the first such near-tie.
NEAR_TIE_NATS = 0.1
# The embedded model reproduces its corpus, so a corpus prompt's continuation is decisive
# (no near-tie) for all of MAX_TOKENS; every comparison covers at least this many tokens.
MIN_COMPARED = 64


def prompt_of(stride: int, offset: int, length: int) -> tuple[int, ...]:
    """Arbitrary token ids (vocabulary 2048): for limits and load, not for comparisons."""
    return tuple((stride * i + offset) % 2000 + 1 for i in range(length))


@functools.cache
def _corpus_prompts() -> dict[str, tuple[int, ...]]:
    """Passages of the embedded model's corpus (its token stream: the concept document,
    then the lesson, each ending in EOS): short, longer than one attention block (256
    tokens here), several blocks; X and Y of equal length for the state-swap proof."""
    from vllm_engine.embedded_model import ensure_embedded_model
    from vllm_engine.embedded_model.texts import EOS_ID, token_stream

    stream = token_stream(ensure_embedded_model())
    first_document_end = stream.index(EOS_ID)
    prompts = {
        "short": stream[2600:2617],
        "over_one_block": stream[100:400],
        "long": stream[first_document_end + 1 :][:1100],
        "x": stream[2000:2400],
    }
    # Y ends on X's last token (both on " the"), so Y[:-1] + X[-1:] == Y: decode asked for X
    # but handed Y's state continues the corpus after Y, decisively, and not the corpus after
    # X, whether prefill sampled Y's first token (decode runs X + that token on the state of
    # all of Y) or left Y's last token to decode (decode runs X on the state of Y[:-1]).
    # Two such passages of the first document, one per TP size.
    ends = [end for end in range(400, first_document_end - MAX_TOKENS) if stream[end - 1] == prompts["x"][-1]]
    y_end = ends[0]
    y_tp2_end = next(end for end in ends if end >= y_end + 200)
    prompts["y"] = stream[y_end - 400 : y_end]
    prompts["y_tp2"] = stream[y_tp2_end - 400 : y_tp2_end]
    return {name: tuple(ids) for name, ids in prompts.items()}


class _Prompts(Mapping[str, tuple[int, ...]]):
    """Read on first use: they need the embedded model's tokenizer (built, if missing, as
    the `model_path` fixture does), which importing this module should not."""

    def __init__(self, *names: str) -> None:
        self._names = names

    def __getitem__(self, name: str) -> tuple[int, ...]:
        if name not in self._names:
            raise KeyError(name)
        return _corpus_prompts()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


PROMPTS = _Prompts("short", "over_one_block", "long", "x", "y")
# The same proof at TP 2 (its bf16 reductions differ), from another passage.
TP2_PROMPTS = _Prompts("y_tp2")


# A stop string the corpus never holds: with it, prefill leaves the first token to decode
# (kv_transfer/producer.py) and the output is unchanged.
UNMATCHED_STOP = ("\u00a7\u00a7",)


def make_request(
    name: str, request_id: str | None = None, logprobs: int | None = None, stop: tuple[str, ...] = ()
) -> GenerateRequest:
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs, stop=stop)
    return GenerateRequest(request_id or name, {**PROMPTS, **TP2_PROMPTS}[name], sampling)


@dataclasses.dataclass(frozen=True)
class Reference:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logprob at each position

    @property
    def decisive(self) -> list[int]:
        """The tokens before the first near-tie: any correct run must reproduce them."""
        k = next((i for i, m in enumerate(self.margins) if m < NEAR_TIE_NATS), len(self.tokens))
        return self.tokens[:k]


def assert_matches(tokens: list[int], ref: Reference) -> None:
    assert len(ref.decisive) >= MIN_COMPARED, "reference has near-ties too early to compare"
    assert tokens[: len(ref.decisive)] == ref.decisive
    assert len(tokens) == len(ref.tokens)


async def collect(stream) -> tuple[list[int], GenerationResult | None]:
    tokens: list[int] = []
    result = None
    async for event in stream:
        if isinstance(event, GenerationResult):
            result = event
        else:
            tokens.extend(event.token_ids)
    return tokens, result


async def decode_tokens(actor, request, handle=None) -> list[int]:
    tokens: list[int] = []
    async for ref in actor.generate.remote(request, handle):
        tokens.extend((await ref).token_ids)
    return tokens


async def decode_after(actor, prefill_result, request) -> list[int]:
    """`request`'s tokens, decoded on the prefill result's handle: the first one if prefill
    sampled it, then what decode streams."""
    first = list(prefill_result.first.token_ids) if prefill_result.first else []
    return first + await decode_tokens(actor, prefill_result.decode_leg(request), prefill_result.handle)


async def reference_run(actor, request) -> Reference:
    tokens: list[int] = []
    margins: list[float] = []
    async for ref in actor.generate.remote(request):
        chunk = await ref
        tokens.extend(chunk.token_ids)
        margins.extend(top[0][1] - top[1][1] for top in chunk.logprobs)
    return Reference(tokens, margins)


async def reference_runs(actor, names: list[str], prefix: str, cache_salt: str = "") -> dict[str, Reference]:
    """The named prompts' references, run at once (one batch): a comparison stops at the
    first near-tie, where batch shape cannot change a choice. `cache_salt`: blocks no other
    request shares (a P/D engine serving its own reference)."""
    requests = [make_request(name, f"{prefix}-{name}", logprobs=2) for name in names]
    runs = [reference_run(actor, dataclasses.replace(r, cache_salt=cache_salt)) for r in requests]
    return dict(zip(names, await asyncio.gather(*runs)))
