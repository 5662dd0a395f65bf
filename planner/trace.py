"""The request trace format shared by the tuner (which simulates it) and the load generator
(which sends it): JSONL rows {"arrival_s", "prompt_tokens", "output_tokens"}."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt_tokens: int
    output_tokens: int


def parse_trace(lines: Iterable[str]) -> list[RequestSpec]:
    """JSONL lines {"arrival_s", "prompt_tokens", "output_tokens"}, sorted by arrival."""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            row = (float(entry["arrival_s"]), int(entry["prompt_tokens"]), int(entry["output_tokens"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"trace line {number}: {err!r}") from err
        if row[0] < 0 or row[1] < 1 or row[2] < 1:
            raise ValueError(f"trace line {number}: need arrival_s >= 0 and token counts >= 1")
        rows.append(row)
    if not rows:
        raise ValueError("trace has no requests")
    rows.sort(key=lambda r: r[0])
    return [RequestSpec(i, *row) for i, row in enumerate(rows)]
