"""A small gRPC client for the Generation service (CLI, tests, benchmarks)."""

from __future__ import annotations

from typing import AsyncIterator

import grpc

from proto.pdserve.v1 import generate_pb2 as pb
from proto.pdserve.v1 import generate_pb2_grpc as pb_grpc


def build_request(
    prompt: str | list[int],
    request_id: str = "",
    **sampling: object,
) -> pb.GenerateRequest:
    message = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if isinstance(prompt, str):
        message.text = prompt
    else:
        message.token_ids.SetInParent()  # an empty id list is still "token_ids", not "no prompt"
        message.token_ids.ids.extend(prompt)
    return message


async def stream_generate(
    channel: grpc.aio.Channel,
    request: pb.GenerateRequest,
    timeout_s: float | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> AsyncIterator[pb.GenerateResponse]:
    """`metadata`: e.g. `ClientCredentials.metadata()` (the bearer token)."""
    stub = pb_grpc.GenerationStub(channel)
    async for response in stub.Generate(request, timeout=timeout_s, metadata=metadata or None):
        yield response
