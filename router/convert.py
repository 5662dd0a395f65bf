"""Explicit encode/decode between the gRPC messages and the internal dataclasses."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Callable

from messages.errors import InvalidRequestError
from messages.requests import GenerateRequest, SamplingConfig
from messages.results import GenerationResult, TokenChunk
from proto.pdserve.v1 import generate_pb2 as pb

DEFAULT_MAX_TOKENS = 64
# A client's request id is shown back to it and written to logs, never used inside engines.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


async def decode_request(
    message: pb.GenerateRequest, tokenize: Callable[[str], list[int]], max_prompt_bytes: int
) -> GenerateRequest:
    """The internal request; text is tokenized on a worker thread, after its size is checked,
    so a multi-MiB prompt never stalls the event loop that streams everyone's tokens."""
    if message.request_id and not _REQUEST_ID.fullmatch(message.request_id):
        raise InvalidRequestError(
            "request_id", "1 to 128 characters from letters, digits and ._:@/+=- (or leave it empty)"
        )
    kind = message.WhichOneof("prompt")
    if kind == "text":
        size = len(message.text.encode())
        if size > max_prompt_bytes:
            raise InvalidRequestError("text", f"{size:,} bytes; at most {max_prompt_bytes:,} for this model")
        prompt = tuple(await asyncio.to_thread(tokenize, message.text))
    elif kind == "token_ids":
        prompt = tuple(message.token_ids.ids)
    else:
        raise InvalidRequestError("prompt", "missing: set `text` or `token_ids`")
    s = message.sampling
    sampling = SamplingConfig(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        temperature=s.temperature if s.HasField("temperature") else 0.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs or None,  # proto3: 0 is unset
    )
    return GenerateRequest(message.request_id or f"req-{uuid.uuid4().hex}", prompt, sampling, message.cache_salt)


def encode_chunk(chunk: TokenChunk) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        chunk=pb.TokenChunk(
            token_ids=chunk.token_ids,
            text=chunk.text,
            logprobs=[
                pb.PositionLogprobs(top=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in position])
                for position in chunk.logprobs
            ],
        )
    )


def encode_final(request_id: str, result: GenerationResult) -> pb.GenerateResponse:
    t = result.timings
    return pb.GenerateResponse(
        final=pb.Final(
            request_id=request_id,
            finish_reason=result.finish_reason,
            usage=pb.Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                cached_tokens=result.cached_tokens,
                draft_tokens=result.draft_tokens,
                accepted_draft_tokens=result.accepted_draft_tokens,
            ),
            timings=pb.Timings(
                queue_s=t.queue_s,
                prefill_s=t.prefill_s,
                transfer_s=t.transfer_s,
                ttft_s=t.ttft_s,
                inter_token=pb.LatencySummary(
                    mean_s=t.inter_token.mean or 0.0,
                    p50_s=t.inter_token.p50 or 0.0,
                    p90_s=t.inter_token.p90 or 0.0,
                    p99_s=t.inter_token.p99 or 0.0,
                    max_s=t.inter_token.max or 0.0,
                ),
                e2e_s=t.e2e_s,
                decode_tokens_per_s=t.decode_tokens_per_s,
                attention_kv_bytes=t.transfer_bytes.attention_kv,
                deltanet_state_bytes=t.transfer_bytes.deltanet_state,
            ),
            prefill_worker=result.prefill_worker,
            decode_worker=result.decode_worker,
        )
    )
