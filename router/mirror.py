"""A router's copy of the controller's pools: membership, liveness and load, fetched once
per health interval (one call per router, however many engines), while the router keeps
its own in-flight counts."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from messages.membership import ClusterView
from router import metrics
from router.journal import RequestJournal
from cluster.pools import Pool

log = logging.getLogger(__name__)


class ControllerMirror:
    def __init__(self, controller: Any, view: ClusterView) -> None:
        self.controller = controller  # Ray actor handle of controller.actor.PoolController
        self.journal = RequestJournal()  # this router's traffic, reported with each view request
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")
        self._last_poll = -1
        self._reachable = True
        self.apply(view)

    def apply(self, view: ClusterView) -> None:
        new_poll = view.poll != self._last_poll
        self.prefill.mirror(view.prefill, new_poll)
        self.decode.mirror(view.decode, new_poll)
        self._last_poll = view.poll
        metrics.observe_pool(self.prefill)
        metrics.observe_pool(self.decode)

    async def refresh(self, poll_timeout_s: float) -> None:
        """Fetch the latest view. Without the controller, keep routing on the last one:
        a dead engine still shows itself by failing the calls made to it."""
        report = self.journal.take()
        try:
            view = await asyncio.wait_for(self.controller.view.remote(report), poll_timeout_s)
        except Exception as err:
            if self._reachable:
                log.warning("controller unreachable (%r): routing on its last view", err)
            self._reachable = False
            return
        if not self._reachable:
            log.warning("controller reachable again")
        self._reachable = True
        self.apply(view)
