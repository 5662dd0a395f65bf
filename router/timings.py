"""Per-request phase timings, measured where each phase happens."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.layout import TransferBytes


@dataclass(frozen=True, slots=True)
class LatencySummary:
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, samples: list[float]) -> "LatencySummary":
        if not samples:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        ordered = sorted(samples)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return cls(sum(ordered) / len(ordered), pct(0.5), pct(0.9), pct(0.99), ordered[-1])


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    queue_s: float  # router arrival -> prefill engine starts (routing, Ray hop)
    prefill_s: float  # prefill engine: prompt in -> blocks ready for transfer
    transfer_s: float  # decode call -> first token: NIXL pull of KV + state, then one step
    ttft_s: float  # router arrival -> first token at the router
    inter_token: LatencySummary
    decode_tokens_per_s: float  # after the first token
    e2e_s: float
    transfer_bytes: TransferBytes
