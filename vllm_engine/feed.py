"""Worker feeds: one connection per router process to each worker actor, carrying every
leg that router starts there: a decode leg's new tokens, a batch per engine step, instead
of one message per request per token (tokens are not held back: a batch goes out as soon as
the step's outputs are in, whatever their number), and a prefill leg's result.

The batches travel over a plain TCP connection from the actor to the router (FeedServer),
not as Ray streaming-generator items: a Ray item costs both ends far more CPU than a socket
write and read, once per batch on the router's hot path. The router starts and aborts its
legs over the same connection too: a Ray call to start a decode leg would sit between the
client's first token (prefill's) and its second, and one to prefill would wake idle threads
at both ends before the prompt reaches the engine. Ray still renews the feed's lease and
tells the router where the feed is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import pickle
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from messages.errors import LegAbortedError
from messages.results import (
    FEED_FRAME_HEADER_BYTES,
    FEED_HEARTBEAT_S,
    FEED_MAX_COMMAND_BYTES,
    FEED_TIMEOUT_S,
    FeedAddress,
    FeedCommand,
    LegEvent,
    LegOutput,
)

# What a worker does with each kind of command a router sends: `handler(subscriber, command)`
# starts or stops a leg in `subscriber`'s feed, or raises why not.
FeedCommands = Mapping[type[FeedCommand], Callable[[str, Any], None]]


@dataclass(slots=True)
class _Feed:
    pending: list[LegEvent] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    legs: set[str] = field(default_factory=set)
    streaming: bool = False  # its subscriber is reading it
    renewed_at: float = field(default_factory=time.monotonic)
    expired: bool = False  # not renewed in time: its subscriber is gone
    sent_at: float = field(default_factory=time.monotonic)  # its last batch, heartbeats included

    def put(self, event: LegEvent) -> None:
        self.pending.append(event)
        self.ready.set()


class FeedHub:
    """The feeds of one worker, and the requests ("legs") each one carries."""

    def __init__(self, timeout_s: float = FEED_TIMEOUT_S, heartbeat_s: float = FEED_HEARTBEAT_S) -> None:
        self._feeds: dict[str, _Feed] = {}
        self._legs: dict[str, asyncio.Task[None]] = {}
        self._closed: set[str] = set()  # subscribers whose feed ended: nobody would read theirs
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._reaper: asyncio.Task[None] | None = None

    async def stream(self, subscriber: str) -> AsyncIterator[list[LegEvent]]:
        """The batches for `subscriber` until it closes the feed, or stops renewing it (it
        died: Ray does not cancel a dead caller's stream), which also aborts every request
        it still has here."""
        feed = self.open(subscriber)
        try:
            while True:
                await feed.ready.wait()
                feed.ready.clear()
                if feed.expired:
                    return
                batch, feed.pending = feed.pending, []
                feed.sent_at = time.monotonic()
                yield batch  # empty: a heartbeat (FEED_HEARTBEAT_S)
        finally:
            self._closed.add(subscriber)
            self._feeds.pop(subscriber, None)
            for leg_id in list(feed.legs):
                self.abort(leg_id)

    def open(self, subscriber: str) -> _Feed:
        """Mark `subscriber`'s feed as read from now on (its stream may start later)."""
        feed = self._feeds.setdefault(subscriber, _Feed())
        feed.streaming = True
        feed.renewed_at = time.monotonic()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._tend())
        return feed

    def is_streaming(self, subscriber: str) -> bool:
        feed = self._feeds.get(subscriber)
        return feed is not None and feed.streaming

    def renew(self, subscriber: str) -> None:
        feed = self._feeds.get(subscriber)
        if feed is not None:
            feed.renewed_at = time.monotonic()

    async def _tend(self) -> None:
        """End the feeds not renewed in time; have the quiet ones send a heartbeat."""
        while self._feeds:
            await asyncio.sleep(min(self._timeout_s / 10, self._heartbeat_s / 2))
            now = time.monotonic()
            for feed in list(self._feeds.values()):
                if not feed.streaming:
                    continue
                if feed.renewed_at < now - self._timeout_s:
                    feed.expired = True
                    feed.ready.set()
                elif feed.sent_at < now - self._heartbeat_s:
                    feed.ready.set()

    def start(self, subscriber: str, leg_id: str, outputs: AsyncIterator[LegOutput]) -> None:
        """Pump one leg's outputs (a decode leg's token chunks, a prefill leg's one result)
        into its subscriber's feed."""
        if leg_id in self._legs:
            raise ValueError(f"request id {leg_id} already has a leg running here")
        if subscriber in self._closed:
            raise ConnectionError(f"the feed of {subscriber} has ended: open a new one to start requests")
        feed = self._feeds.setdefault(subscriber, _Feed())  # the feed may open just after
        feed.legs.add(leg_id)
        task = asyncio.get_running_loop().create_task(self._pump(subscriber, feed, leg_id, outputs))
        self._legs[leg_id] = task

    def requests_by_feed(self) -> tuple[tuple[str, int], ...]:
        """How many requests each subscriber has going here (messages.reports.EngineLoad)."""
        return tuple((subscriber, len(feed.legs)) for subscriber, feed in self._feeds.items() if feed.legs)

    def refuse(self, subscriber: str, leg_id: str, error: BaseException) -> None:
        """Tell `subscriber` that its request `leg_id` was not started, and why."""
        feed = self._feeds.get(subscriber)
        if feed is not None:
            feed.put(LegEvent(leg_id, error=error))

    def abort(self, leg_id: str) -> None:
        """Stop one leg: cancelling its pump closes its engine stream, which aborts it; its
        router hears a LegAbortedError (unless the leg had ended)."""
        task = self._legs.get(leg_id)
        if task is not None:
            task.cancel()

    async def _pump(self, subscriber: str, feed: _Feed, leg_id: str, outputs: AsyncIterator[LegOutput]) -> None:
        try:
            async for output in outputs:
                feed.put(LegEvent(leg_id, output))
        except asyncio.CancelledError:
            # The last word a router that timed a prefill out waits for (a result that came
            # first has blocks to free); a decode leg's router has stopped listening.
            feed.put(LegEvent(leg_id, error=LegAbortedError(f"{leg_id} was aborted")))
        except Exception as exc:  # the leg's own failure, for its router to raise
            feed.put(LegEvent(leg_id, error=exc))
        finally:
            feed.legs.discard(leg_id)
            del self._legs[leg_id]
            if not feed.legs and not feed.streaming and self._feeds.get(subscriber) is feed:
                # Started for a router that never read this feed (it sent the request to a
                # restarted actor): the request is over, its events have no reader.
                del self._feeds[subscriber]
            await outputs.aclose()


class FeedServer:
    """Serves a FeedHub's feeds over TCP, one connection per router process: the router
    sends its subscriber id, the feed's token and a newline, then command frames (StartLeg,
    StartPrefill, AbortLeg), and reads frames of batches (the first one empty: the feed is
    open) until either side closes. A router that goes away closes the connection, which
    ends its feed and aborts its legs at once (the feed's lease still covers a peer that
    vanishes without closing it).

    The token comes from `address()`, which only callers of the actor (through Ray) reach:
    a peer without it is dropped after its hello line. Frames are pickles, as Ray's own are,
    for the cluster's trusted network; even so, a router's frames may only hold pdserve's
    message classes (anything else ends the connection), so a stray peer that got the token
    still cannot run code here."""

    def __init__(self, hub: FeedHub, host: str, commands: FeedCommands, hello_timeout_s: float = 10.0) -> None:
        """`commands`: the worker's handler of each command it takes; a router sending
        another kind loses its connection."""
        self._hub = hub
        self._host = host
        self._commands = commands
        self._hello_timeout_s = hello_timeout_s
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None

    async def address(self) -> FeedAddress:
        """Where to connect, and the token to say hello with; the server starts on first
        use, on the caller's loop."""
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self._host, 0)
        return FeedAddress(self._host, self._server.sockets[0].getsockname()[1], self._token)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        serving = asyncio.current_task()
        try:
            try:  # a peer that does not say who it is soon, in one short line, is dropped
                hello = await asyncio.wait_for(reader.readline(), self._hello_timeout_s)
            except (TimeoutError, ValueError):
                return
            subscriber, _, token = hello.decode(errors="replace").strip().partition(" ")
            if not subscriber or not hmac.compare_digest(token.encode(), self._token.encode()):
                return
            if self._hub.is_streaming(subscriber):  # one reader per feed
                return
            # The router's frames: its commands. End of input (or a bad frame) ends its feed.
            commands = asyncio.ensure_future(self._obey(subscriber, reader))

            def router_left(_: asyncio.Future[None]) -> None:
                serving.cancel()  # type: ignore[union-attr]

            commands.add_done_callback(router_left)
            try:
                self._hub.open(subscriber)
                writer.write(bytes(FEED_FRAME_HEADER_BYTES))
                async with contextlib.aclosing(self._hub.stream(subscriber)) as batches:
                    async for batch in batches:
                        payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                        writer.write(len(payload).to_bytes(FEED_FRAME_HEADER_BYTES, "big") + payload)
                        await writer.drain()
            finally:
                commands.remove_done_callback(router_left)
                commands.cancel()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the router left: its feed has ended above
        finally:
            writer.close()

    async def _obey(self, subscriber: str, reader: asyncio.StreamReader) -> None:
        """Run the router's commands until it closes the connection or sends a bad frame."""
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(FEED_FRAME_HEADER_BYTES), "big")
                if size > FEED_MAX_COMMAND_BYTES:
                    return
                payload = await reader.readexactly(size)
                try:
                    command = _load_command(payload)
                except Exception:  # not a frame a router writes: end the connection, quietly
                    return
                handler = self._commands.get(type(command))
                if handler is None:
                    return
                try:
                    handler(subscriber, command)
                except Exception as exc:  # refused: the leg's own error, for its router
                    self._hub.refuse(subscriber, command.leg_id, exc)
        except (asyncio.IncompleteReadError, ConnectionError):
            return


class _CommandUnpickler(pickle.Unpickler):
    """Loads only the message classes a router's commands are made of (and plain data)."""

    _ALLOWED_MODULES = frozenset({"messages.requests", "messages.results", "messages.transfer"})

    def find_class(self, module: str, name: str) -> type:
        if module not in self._ALLOWED_MODULES:
            raise pickle.UnpicklingError(f"{module}.{name} is not a feed command message")
        found = super().find_class(module, name)
        if not isinstance(found, type):
            raise pickle.UnpicklingError(f"{module}.{name} is not a feed command message")
        return found


def _load_command(payload: bytes) -> object:
    return _CommandUnpickler(io.BytesIO(payload)).load()
