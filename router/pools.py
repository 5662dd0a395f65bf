"""The prefill and decode actor pools and how the router picks from them.

Picking uses what the router already knows exactly and for free (requests it has in
flight on each actor) plus each actor's cheap load report (free KV blocks), refreshed in
the background: no per-request round trip to the workers.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from vllm_engine.loop import EngineLoad


@dataclass(slots=True)
class Member:
    name: str
    actor: Any  # Ray actor handle
    outstanding_requests: int = 0
    outstanding_prompt_tokens: int = 0
    load: EngineLoad | None = None


@dataclass(slots=True)
class Pool:
    role: str
    members: list[Member] = field(default_factory=list)
    _tiebreak: itertools.count = field(default_factory=itertools.count)

    def pick_prefill(self) -> Member:
        """Least outstanding prompt tokens: prefill time is proportional to them."""
        self._require_members()
        turn = next(self._tiebreak)
        return min(
            self.members,
            key=lambda m: (m.outstanding_prompt_tokens, (self.members.index(m) - turn) % len(self.members)),
        )

    def pick_decode(self) -> Member:
        """Fewest running, then most free KV/state capacity."""
        self._require_members()
        turn = next(self._tiebreak)
        return min(
            self.members,
            key=lambda m: (
                m.outstanding_requests,
                -(m.load.free_blocks if m.load else 0),
                (self.members.index(m) - turn) % len(self.members),
            ),
        )

    def _require_members(self) -> None:
        if not self.members:
            raise NoWorkerError(f"no live {self.role} actor")

    async def refresh_loads(self) -> None:
        reports = await asyncio.gather(*(m.actor.load.remote() for m in self.members), return_exceptions=True)
        for member, report in zip(self.members, reports):
            member.load = report if isinstance(report, EngineLoad) else None


class NoWorkerError(RuntimeError):
    pass
