"""The router's end of the decode feeds (decode_worker/feed.py): one Ray stream per decode
actor for this router process, fanned out to the requests it carries."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import ray

from messages.results import FEED_RENEW_S, LegEvent

log = logging.getLogger(__name__)


class DecodeFeed:
    """This router's feed from one decode actor. Each request reads its own queue of
    LegEvents; if the feed breaks (the actor died), every request on it gets the error.
    While it runs, the router renews it: a feed left unrenewed (its router died) ends on
    the actor, with every request on it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.subscriber = f"router-{uuid.uuid4().hex[:12]}"
        self._legs: dict[str, asyncio.Queue[LegEvent | BaseException]] = {}
        self._stream = actor.feed.remote(self.subscriber)
        self._loop = asyncio.get_running_loop()
        self._pump: asyncio.Task[None] = self._loop.create_task(self._run())
        self._renewal: asyncio.Task[None] = self._loop.create_task(self._renew())

    @property
    def usable(self) -> bool:
        """False once the feed broke, or when asked from another event loop than its own
        (tests run each call in a fresh loop; a server has one)."""
        return not self._pump.done() and self._loop is asyncio.get_running_loop()

    def open_leg(self, leg_id: str) -> asyncio.Queue[LegEvent | BaseException]:
        """Listen for `leg_id` before starting it, so no early batch is missed."""
        events: asyncio.Queue[LegEvent | BaseException] = asyncio.Queue()
        self._legs[leg_id] = events
        return events

    def close_leg(self, leg_id: str) -> None:
        self._legs.pop(leg_id, None)

    def close(self) -> None:
        """End the feed on the actor too, which aborts any request still on it."""
        self._renewal.cancel()
        ray.cancel(self._stream)

    async def _renew(self) -> None:
        while not self._pump.done():
            self.actor.renew_feed.remote(self.subscriber)  # no reply needed: a lost one is renewed next time
            await asyncio.sleep(FEED_RENEW_S)

    async def _run(self) -> None:
        try:
            async for ref in self._stream:
                for event in await ref:
                    events = self._legs.get(event.leg_id)
                    if events is not None:  # None: the request left and aborted it
                        events.put_nowait(event)
            raise ConnectionError("decode feed ended")  # only a dying actor ends it
        except asyncio.CancelledError:
            raise
        except Exception as err:  # every listener must hear of it
            log.warning("decode feed from %s broke: %r", self.subscriber, err)
            for events in self._legs.values():
                events.put_nowait(err)
