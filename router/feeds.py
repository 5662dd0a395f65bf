"""The router's end of the decode feeds (decode_worker/feed.py): one Ray stream per decode
actor for this router process, fanned out to the requests it carries."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from messages.errors import DecodeFailedError
from messages.results import FEED_RENEW_S, LegEvent

log = logging.getLogger(__name__)


class LegInbox:
    """One request's events from its feed, taken all at once.

    Not an asyncio.Queue read under asyncio.timeout: per token those cost a future, a timer
    and three get_running_loop() calls, each a getpid() syscall on Python 3.11 (a py-spy
    profile of the router under bench/router_capacity.py put 12% of its event loop there).
    Here a token costs a list append; a stalled request is found by its feed's periodic
    check instead of a timer per token."""

    __slots__ = ("_events", "_loop", "_waiter", "last_event_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._events: list[LegEvent | BaseException] = []
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self.last_event_at = time.monotonic()

    def put(self, event: LegEvent | BaseException) -> None:
        self._events.append(event)
        self.last_event_at = time.monotonic()
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


class DecodeFeed:
    """This router's feed from the decode actor `name`. Each request reads its own inbox of
    LegEvents; if the feed breaks (the actor died), every request on it gets the error, and
    a request that hears nothing for `stall_timeout_s` gets a DecodeFailedError. While it
    runs, the router renews it: a feed left unrenewed (its router died) ends on the actor,
    with every request on it."""

    def __init__(self, name: str, actor: Any, stall_timeout_s: float) -> None:
        self.name = name
        self.actor = actor
        self.subscriber = f"router-{uuid.uuid4().hex[:12]}"
        self._stall_timeout_s = stall_timeout_s
        self._legs: dict[str, LegInbox] = {}
        self._stream = actor.feed.remote(self.subscriber)
        self._loop = asyncio.get_running_loop()
        self._pump: asyncio.Task[None] = self._loop.create_task(self._run())
        self._renewal: asyncio.Task[None] = self._loop.create_task(self._tend())

    @property
    def usable(self) -> bool:
        """False once the feed broke, or when asked from another event loop than its own
        (tests run each call in a fresh loop; a server has one)."""
        return not self._pump.done() and self._loop is asyncio.get_running_loop()

    def open_leg(self, leg_id: str) -> LegInbox:
        """Listen for `leg_id` before starting it, so no early batch is missed."""
        inbox = self._legs[leg_id] = LegInbox(self._loop)
        return inbox

    def close_leg(self, leg_id: str) -> None:
        self._legs.pop(leg_id, None)

    def close(self) -> None:
        """End the feed on the actor too, which aborts any request still on it."""
        self._renewal.cancel()
        ray.cancel(self._stream)

    async def _tend(self) -> None:
        """Renew the feed's lease, and fail requests that have stalled."""
        while not self._pump.done():
            self.actor.renew_feed.remote(self.subscriber)  # no reply needed: a lost one is renewed next time
            self.fail_stalled()
            await asyncio.sleep(FEED_RENEW_S)

    def fail_stalled(self) -> None:
        """Every request that has heard nothing for `stall_timeout_s` gets a DecodeFailedError
        (it then aborts itself on the actor)."""
        quiet_since = time.monotonic() - self._stall_timeout_s
        for leg_id, inbox in self._legs.items():
            if inbox.last_event_at < quiet_since:
                inbox.put(
                    DecodeFailedError(
                        f"decode actor {self.name} sent nothing for {self._stall_timeout_s:.0f}s while serving {leg_id}"
                    )
                )

    async def _run(self) -> None:
        try:
            async for ref in self._stream:
                for event in await ref:
                    inbox = self._legs.get(event.leg_id)
                    if inbox is not None:  # None: the request left and aborted it
                        inbox.put(event)
            raise ConnectionError("decode feed ended")  # only a dying actor ends it
        except asyncio.CancelledError:
            raise
        except Exception as err:  # every listener must hear of it
            log.warning("decode feed from %s broke: %r", self.subscriber, err)
            for inbox in self._legs.values():
                inbox.put(err)
