"""The router's record of its traffic for the controller's planner: finished requests as
measured here (arrival, lengths, TTFT, mean inter-token time) and arrivals, handed over with
each view request (router/mirror.py)."""

from __future__ import annotations

import time

from messages.membership import RouterAdmission, RouterReport
from messages.results import GenerationResult
from messages.timings import FinishedRequest


class RequestJournal:
    def __init__(self, max_entries: int = 100_000) -> None:
        self._finished: list[FinishedRequest] = []
        self._arrivals = 0
        self._max_entries = max_entries  # a controller unreachable for long: keep the newest

    def arrived(self) -> float:
        """Count an arrival; returns its wall-clock time (comparable between processes)."""
        self._arrivals += 1
        return time.time()

    def finished(self, arrival_s: float, result: GenerationResult) -> None:
        if result.completion_tokens < 1 or result.prompt_tokens < 1:
            return
        rate = result.timings.decode_tokens_per_s
        itl = 1 / rate if rate > 0 else 0.0
        cached = min(result.cached_tokens, result.prompt_tokens - 1)
        self._finished.append(
            FinishedRequest(
                arrival_s, result.prompt_tokens, result.completion_tokens, result.timings.ttft_s, itl, cached
            )
        )
        if len(self._finished) > self._max_entries:
            del self._finished[: len(self._finished) - self._max_entries]

    def take(self, admission: RouterAdmission | None = None) -> RouterReport:
        report = RouterReport(tuple(self._finished), self._arrivals, admission)
        self._finished, self._arrivals = [], 0
        return report
