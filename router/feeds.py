"""The router's end of the worker feeds (vllm_engine/feed.py): one connection per worker
actor for this router process, fanned out to the legs it carries (decode legs' tokens into
their inboxes, prefill legs' results into their futures)."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from typing import Any, Callable

from messages.errors import FeedLostError, LegStalledError
from messages.requests import GenerateRequest
from messages.results import (
    FEED_FRAME_HEADER_BYTES,
    FEED_RENEW_S,
    AbortLeg,
    FeedAddress,
    FeedCommand,
    LegEvent,
    PrefillResult,
    StartLeg,
    StartPrefill,
)
from messages.transfer import TransferHandle

log = logging.getLogger(__name__)


class LegInbox:
    """One request's events from its feed, taken all at once.

    Not an asyncio.Queue read under asyncio.timeout: per token those cost a future, a timer
    and three get_running_loop() calls, each a getpid() syscall on Python 3.11, on the
    router's busiest path. Here a token costs a list append; a stalled request is found by
    its feed's periodic check instead of a timer per token."""

    __slots__ = ("_events", "_loop", "_waiter", "last_event_at", "started")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._events: list[LegEvent | BaseException] = []
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self.last_event_at = time.monotonic()
        self.started = False  # an event came: the engine is decoding it

    def put(self, event: LegEvent | BaseException) -> None:
        self._events.append(event)
        self.last_event_at = time.monotonic()
        self.started = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[LegEvent | BaseException]:
        """Every event that has arrived, waiting for the first if none has."""
        while not self._events:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        events, self._events = self._events, []
        return events


class WorkerFeed:
    """This router's feed from the worker actor `name`, and its legs' way in: each is started
    and aborted with a frame on the feed's connection; a decode leg reads its own inbox of
    LegEvents, a prefill leg awaits its result's future. If the feed breaks (the actor died),
    every leg on it gets a FeedLostError, and a stalled leg a LegStalledError (`fail_stalled`
    says when). Closing it ends the feed on the actor, with every leg on it; while it runs,
    the router also renews its lease there (which ends a feed whose router vanished without
    closing it)."""

    def __init__(
        self,
        name: str,
        actor: Any,
        stall_timeout_s: float,
        first_event_timeout_s: float,
        on_orphaned_prefill: Callable[[PrefillResult], None] = lambda result: None,
    ) -> None:
        """`on_orphaned_prefill(result)`: a prefill's result came after its leg had failed
        (stalled: the feed was silent, then spoke again); its blocks wait for a decode."""
        self.name = name
        self.actor = actor
        self.subscriber = f"router-{uuid.uuid4().hex}"
        self._stall_timeout_s = stall_timeout_s
        self._first_event_timeout_s = first_event_timeout_s
        self._on_orphaned_prefill = on_orphaned_prefill
        self._heard_at = time.monotonic()  # the feed's last frame (heartbeats included)
        self._legs: dict[str, LegInbox] = {}
        self._prefills: dict[str, asyncio.Future[PrefillResult]] = {}
        self._unsent: list[FeedCommand] = []
        self._writer: asyncio.StreamWriter | None = None
        self._loop = asyncio.get_running_loop()
        # Set once the actor has opened the feed (requests started before would be lost):
        # None, or the error that kept it from opening.
        self._opened: asyncio.Future[BaseException | None] = self._loop.create_future()
        self._pump: asyncio.Task[None] = self._loop.create_task(self._run())
        self._renewal: asyncio.Task[None] = self._loop.create_task(self._tend())

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop it runs on."""
        return self._loop

    @property
    def usable(self) -> bool:
        """False once the feed broke, or when asked from another event loop than its own
        (tests run each call in a fresh loop; a server has one)."""
        return not self._pump.done() and self._loop is asyncio.get_running_loop()

    async def opened(self) -> None:
        """Wait until requests can start on this feed; raises FeedLostError if it never opens."""
        error = await asyncio.shield(self._opened)
        if error is not None:
            raise error

    def open_leg(self, leg_id: str) -> LegInbox:
        """Listen for `leg_id` before starting it, so no early batch is missed."""
        inbox = self._legs[leg_id] = LegInbox(self._loop)
        return inbox

    def start_leg(self, request: GenerateRequest, handle: TransferHandle | None) -> None:
        """Start decoding `request` (opened with `open_leg`, on an opened feed); a refusal
        arrives in its inbox as the leg's error."""
        self._send(StartLeg(request, handle))

    def prefill(self, request: GenerateRequest) -> asyncio.Future[PrefillResult]:
        """Prefill `request` on the actor (as soon as the feed opens). The future settles with
        the result or the error that ended the leg (a refusal, LegAbortedError after
        `abort_leg`, FeedLostError, LegStalledError) whether or not anyone still awaits it:
        an abandoned leg's late result still names the blocks to free."""
        result = self._prefills[request.request_id] = self._loop.create_future()
        self._send(StartPrefill(request))
        return result

    def abort_leg(self, leg_id: str) -> None:
        """Stop `leg_id` on the actor. On a broken feed there is nothing left to stop: the
        actor aborted the feed's legs when its connection closed."""
        self._send(AbortLeg(leg_id))

    def _send(self, command: FeedCommand) -> None:
        if self._writer is None and not self._opened.done():
            self._unsent.append(command)  # written as the feed opens
            return
        if self._writer is None or self._writer.is_closing():
            return  # never opened or broken: the leg hears why
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(len(payload).to_bytes(FEED_FRAME_HEADER_BYTES, "big") + payload)

    def close_leg(self, leg_id: str) -> None:
        self._legs.pop(leg_id, None)

    def close(self) -> None:
        """End the feed on the actor too (its connection closes), which aborts any request
        still on it."""
        self._renewal.cancel()
        self._pump.cancel()

    async def aclose(self) -> None:
        """`close()`, then wait until its connection has closed (on its own loop)."""
        self.close()
        await asyncio.gather(self._pump, self._renewal, return_exceptions=True)

    async def _tend(self) -> None:
        """Renew the feed's lease, and fail requests that have stalled."""
        while not self._pump.done():
            self.actor.renew_feed.remote(self.subscriber)  # no reply needed: a lost one is renewed next time
            self.fail_stalled()
            await asyncio.sleep(FEED_RENEW_S)

    def fail_stalled(self) -> None:
        """A decode leg stalls, gets a LegStalledError (then aborts itself on the actor, and
        moves to another one), when it hears nothing for `stall_timeout_s` and either the
        whole feed was as quiet (the actor is gone, stuck or cut off: its heartbeats stopped)
        or its tokens had begun (decoding stopped). Before its first token a leg on a live
        feed may wait `first_event_timeout_s`: it may be prefilling a long prompt on the
        decode engine, or queued there behind others. A prefill leg stalls only with its
        feed (the router's prefill timeout bounds a slow one)."""
        now = time.monotonic()
        feed_silent = now - self._heard_at > self._stall_timeout_s
        if feed_silent:
            stalled = LegStalledError(f"worker actor {self.name} sent nothing for {now - self._heard_at:.0f}s")
            self._settle_prefills(stalled)
        for leg_id, inbox in self._legs.items():
            quiet = now - inbox.last_event_at
            limit = self._stall_timeout_s if inbox.started or feed_silent else self._first_event_timeout_s
            if quiet > limit:
                why = "sent nothing" if feed_silent else "sent no token of it"
                inbox.put(LegStalledError(f"decode actor {self.name} {why} for {quiet:.0f}s while serving {leg_id}"))

    def _settle_prefills(self, error: BaseException) -> None:
        prefills, self._prefills = self._prefills, {}
        for result in prefills.values():
            if not result.done():
                result.set_exception(error)

    async def _run(self) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            address: FeedAddress = await self.actor.feed_address.remote()
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(f"{self.subscriber} {address.token}\n".encode())
            if int.from_bytes(await reader.readexactly(FEED_FRAME_HEADER_BYTES), "big") != 0:
                raise ConnectionError("the worker actor did not open the feed")
            self._writer = writer
            unsent, self._unsent = self._unsent, []
            for command in unsent:
                self._send(command)
            self._heard_at = time.monotonic()
            self._opened.set_result(None)
            while True:
                size = int.from_bytes(await reader.readexactly(FEED_FRAME_HEADER_BYTES), "big")
                batch = pickle.loads(await reader.readexactly(size))
                self._heard_at = time.monotonic()
                for event in batch:
                    inbox = self._legs.get(event.leg_id)
                    if inbox is not None:
                        inbox.put(event)
                    elif (result := self._prefills.pop(event.leg_id, None)) is not None:
                        _settle(result, event)
                    elif isinstance(event.output, PrefillResult):
                        self._on_orphaned_prefill(event.output)
                    # else: a decode leg whose request left and aborted it
        except asyncio.CancelledError:
            raise
        except Exception as err:  # only a dying actor (or network) ends it: every listener must hear of it
            log.warning("feed from %s (%s) broke: %r", self.name, self.subscriber, err)
            lost = FeedLostError(f"the feed from worker actor {self.name} broke: {err!r}")
            if not self._opened.done():
                self._opened.set_result(lost)
            for inbox in self._legs.values():
                inbox.put(lost)
            self._settle_prefills(lost)
        finally:
            closed = FeedLostError(f"the feed from worker actor {self.name} was closed")
            if not self._opened.done():  # closed before it opened
                self._opened.set_result(closed)
            self._settle_prefills(closed)
            if writer is not None:
                writer.close()


def _settle(result: asyncio.Future[PrefillResult], event: LegEvent) -> None:
    if result.done():
        return
    if event.error is not None:
        result.set_exception(event.error)
    else:
        result.set_result(event.output)
