"""A router's copy of the controller's pools: membership, liveness and load, fetched once
per health interval (one call per router, however many engines), while the router keeps
its own in-flight counts."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from messages.membership import AdmissionLimits, ClusterView, RouterAdmission
from router import metrics
from router.journal import RequestJournal
from cluster.pools import Pool

log = logging.getLogger(__name__)


class ControllerMirror:
    def __init__(self, controller: Any, view: ClusterView, router: str = "router", tier_size: int = 1) -> None:
        self.controller = controller  # Ray actor handle of controller.actor.PoolController
        self.router = router  # this router's name, unique in the tier
        self.tier_size = tier_size
        self.journal = RequestJournal()  # this router's traffic, reported with each view request
        # This router's admission counts, reported with each view request, and its share of
        # the tier's limits that comes back (controller/admission_grants.py).
        self._admission: RouterAdmission | None = None
        self.grant: AdmissionLimits | None = None
        self.prefill = Pool("prefill")
        self.decode = Pool("decode")
        self._last_poll = -1
        self._reachable = True
        self.grant = view.admission_grant  # kept as it was while the controller is unreachable
        self.apply(view)

    def share(self, in_flight: int, waiting: int, limits: AdmissionLimits) -> None:
        """What this router holds, and the tier's limits: sent with the next view request."""
        self._admission = RouterAdmission(self.router, in_flight, waiting, limits, self.tier_size)

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
        report = self.journal.take(self._admission)
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
        self.grant = view.admission_grant  # kept as it was while the controller is unreachable
        self.apply(view)
