"""Stand-in worker actors for fast tests of the feed path: a real FeedHub and FeedServer on a
loopback socket behind the two Ray methods a router calls (`feed_address`, `renew_feed`),
with legs that stream or answer on the test's word instead of an engine's."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from messages.errors import InvalidRequestError
from messages.requests import GenerateRequest
from messages.results import AbortLeg, PrefillResult, StartLeg, StartPrefill, TokenChunk
from messages.transfer import TransferBytes, TransferHandle
from vllm_engine.feed import FeedHub, FeedServer


class Method:
    """An actor method's `.remote(...)`: the reply function's result (a coroutine to await,
    or None for a call nobody awaits)."""

    def __init__(self, reply: Callable[..., Any]) -> None:
        self._reply = reply

    def remote(self, *args: Any) -> Any:
        return self._reply(*args)


class SilentActor:
    """A worker actor whose feed never opens (the router's side under test)."""

    def __init__(self) -> None:
        self.feed_address = Method(lambda: asyncio.Event().wait())  # never connects
        self.renew_feed = Method(lambda *args: None)


async def tokens(step: asyncio.Event, n: int, closed: list[str], name: str):  # noqa: ANN201
    """`n` token chunks, one each time `step` is set; `name` joins `closed` when it ends."""
    try:
        for i in range(n):
            await step.wait()
            yield TokenChunk((i,), str(i), "length" if i == n - 1 else None)
    finally:
        closed.append(name)


def prefill_result(request: GenerateRequest) -> PrefillResult:
    blocks = ((1, 2),)
    handle = TransferHandle(request.request_id, "prefill", "127.0.0.1", 1, blocks, 2, 0.0, TransferBytes(0, 0), {})
    return PrefillResult(handle, 0.01, TokenChunk((9,), "z"), cached_tokens=len(request.prompt_token_ids))


class FeedActor:
    """A worker actor's feed side. A decode leg streams `len(prompt)` tokens, one per `step`;
    a prefill leg answers its result once `prefill_gate` is set. Either is refused if its
    prompt holds a 0. Ended legs' ids join `closed`; `prefills` counts prefills started."""

    def __init__(self, heartbeat_s: float = 1.0) -> None:
        self.hub = FeedHub(heartbeat_s=heartbeat_s)
        self.step = asyncio.Event()
        self.prefill_gate = asyncio.Event()
        self.closed: list[str] = []
        self.prefills = 0
        commands = {
            StartLeg: lambda subscriber, command: self._start_leg(subscriber, command.request),
            StartPrefill: lambda subscriber, command: self._start_prefill(subscriber, command.request),
            AbortLeg: lambda _subscriber, command: self.hub.abort(command.leg_id),
        }
        self.server = FeedServer(self.hub, "127.0.0.1", commands)
        self.feed_address = Method(self.server.address)
        self.renew_feed = Method(lambda *args: None)

    def _start_leg(self, subscriber: str, request: GenerateRequest) -> None:
        _refuse_a_zero(request)
        leg_id = request.request_id
        self.hub.start(subscriber, leg_id, tokens(self.step, len(request.prompt_token_ids), self.closed, leg_id))

    def _start_prefill(self, subscriber: str, request: GenerateRequest) -> None:
        self.prefills += 1
        _refuse_a_zero(request)
        self.hub.start(subscriber, request.request_id, self._prefilled(request))

    async def _prefilled(self, request: GenerateRequest):  # noqa: ANN202
        try:
            await self.prefill_gate.wait()
            yield prefill_result(request)
        finally:
            self.closed.append(request.request_id)


def _refuse_a_zero(request: GenerateRequest) -> None:
    if 0 in request.prompt_token_ids:
        raise InvalidRequestError("prompt_token_ids", "hold a 0")
