"""Prompts and colocated reference outputs that disaggregated runs are compared against."""

from __future__ import annotations

import dataclasses

from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult

MAX_TOKENS = 24
# bf16 greedy decoding: where the reference's top two candidates are closer than this,
# batch shape alone can flip the choice. Compare up to the first such near-tie.
NEAR_TIE_NATS = 0.1
MIN_COMPARED = 10



def prompt_of(stride: int, offset: int, length: int) -> tuple[int, ...]:
    return tuple((stride * i + offset) % 2000 + 1 for i in range(length))


# Token-id prompts (vocabulary 2048): short, longer than one attention block (256 tokens
# here), several blocks; X and Y of equal length for the state-swap proof. Chosen so that
# the random-weight model's greedy reference has no near-tie in its first 10+ tokens.
PROMPTS = {
    "short": prompt_of(17, 1, 17),
    "over_one_block": prompt_of(41, 1, 300),
    "long": prompt_of(7, 5, 1100),
    "x": prompt_of(43, 5, 400),
    "y": prompt_of(17, 2, 400),
}
# What decode must produce if it really continues Y's transferred state while being
# asked for X: prefill holds N-1 tokens of Y, decode feeds X's last token.
PROMPTS["y_then_last_of_x"] = PROMPTS["y"][:-1] + PROMPTS["x"][-1:]
# The same proof at TP 2, whose bf16 reductions differ: a Y whose TP-2 continuation of X's
# last token has 15 decisive tokens (17/2's has 8).
TP2_PROMPTS = {"y_tp2": prompt_of(37, 3, 400)}
TP2_PROMPTS["y_tp2_then_last_of_x"] = TP2_PROMPTS["y_tp2"][:-1] + PROMPTS["x"][-1:]


def make_request(name: str, request_id: str | None = None, logprobs: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id or name, {**PROMPTS, **TP2_PROMPTS}[name], SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
    )


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


async def reference_run(actor, request) -> Reference:
    tokens: list[int] = []
    margins: list[float] = []
    async for ref in actor.generate.remote(request):
        chunk = await ref
        tokens.extend(chunk.token_ids)
        margins.extend(top[0][1] - top[1][1] for top in chunk.logprobs)
    return Reference(tokens, margins)


