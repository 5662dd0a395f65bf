"""Decode feeds: one stream per router process carrying every one of its requests' new
tokens, a batch per engine step, instead of one Ray stream item per request per token.

Ray charges each streamed item an object ref, a report to the caller and a wake-up on both
sides (bench/router_capacity.py measured ~0.3 ms of the router's Ray IO thread per token
that way); a batch per step pays that once for the whole batch. Tokens are not held back:
a batch goes out as soon as the step's outputs are in, whatever their number.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from messages.results import FEED_TIMEOUT_S, LegEvent, TokenChunk


@dataclass(slots=True)
class _Feed:
    pending: list[LegEvent] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    legs: set[str] = field(default_factory=set)
    streaming: bool = False  # its subscriber is reading it
    renewed_at: float = field(default_factory=time.monotonic)
    expired: bool = False  # not renewed in time: its subscriber is gone

    def put(self, event: LegEvent) -> None:
        self.pending.append(event)
        self.ready.set()


class FeedHub:
    """The feeds of one decode worker, and the requests ("legs") each one carries."""

    def __init__(self, timeout_s: float = FEED_TIMEOUT_S) -> None:
        self._feeds: dict[str, _Feed] = {}
        self._legs: dict[str, asyncio.Task[None]] = {}
        self._closed: set[str] = set()  # subscribers whose feed ended: nobody would read theirs
        self._timeout_s = timeout_s
        self._reaper: asyncio.Task[None] | None = None

    async def stream(self, subscriber: str) -> AsyncIterator[list[LegEvent]]:
        """The batches for `subscriber` until it closes the feed, or stops renewing it (it
        died: Ray does not cancel a dead caller's stream), which also aborts every request
        it still has here."""
        feed = self._feeds.setdefault(subscriber, _Feed())
        feed.streaming = True
        feed.renewed_at = time.monotonic()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._expire_unrenewed())
        try:
            while True:
                await feed.ready.wait()
                feed.ready.clear()
                if feed.expired:
                    return
                batch, feed.pending = feed.pending, []
                yield batch
        finally:
            self._closed.add(subscriber)
            self._feeds.pop(subscriber, None)
            for leg_id in list(feed.legs):
                self.abort(leg_id)

    def renew(self, subscriber: str) -> None:
        feed = self._feeds.get(subscriber)
        if feed is not None:
            feed.renewed_at = time.monotonic()

    async def _expire_unrenewed(self) -> None:
        while self._feeds:
            await asyncio.sleep(self._timeout_s / 10)
            deadline = time.monotonic() - self._timeout_s
            for feed in list(self._feeds.values()):
                if feed.streaming and feed.renewed_at < deadline:
                    feed.expired = True
                    feed.ready.set()

    def start(self, subscriber: str, leg_id: str, chunks: AsyncIterator[TokenChunk]) -> None:
        """Pump one request's chunks into its subscriber's feed."""
        if leg_id in self._legs:
            raise ValueError(f"request id {leg_id} is already being decoded here")
        if subscriber in self._closed:
            raise ConnectionError(f"the feed of {subscriber} has ended: open a new one to start requests")
        feed = self._feeds.setdefault(subscriber, _Feed())  # the feed may open just after
        feed.legs.add(leg_id)
        task = asyncio.get_running_loop().create_task(self._pump(subscriber, feed, leg_id, chunks))
        self._legs[leg_id] = task

    def abort(self, leg_id: str) -> None:
        """Stop one request: cancelling its pump closes its engine stream, which aborts it."""
        task = self._legs.get(leg_id)
        if task is not None:
            task.cancel()

    async def _pump(self, subscriber: str, feed: _Feed, leg_id: str, chunks: AsyncIterator[TokenChunk]) -> None:
        try:
            async for chunk in chunks:
                feed.put(LegEvent(leg_id, chunk=chunk))
        except asyncio.CancelledError:
            pass  # aborted: whoever aborted it is not listening
        except Exception as exc:  # the request's own failure, for its router to raise
            feed.put(LegEvent(leg_id, error=exc))
        finally:
            feed.legs.discard(leg_id)
            del self._legs[leg_id]
            if not feed.legs and not feed.streaming and self._feeds.get(subscriber) is feed:
                # Started for a router that never read this feed (it sent the request to a
                # restarted actor): the request is over, its events have no reader.
                del self._feeds[subscriber]
            await chunks.aclose()
