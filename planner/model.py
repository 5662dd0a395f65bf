"""Performance model of one serving instance, fitted from probe measurements.

A probe (run on the real hardware) writes one JSON file:

    {"hardware": "4xH100", "model": "Qwen3.5-27B",
     "prefill":  [{"prompt_tokens": 2048, "batch_tokens": 8192, "seconds": 2.5}, ...],
     "decode":   [{"batch_size": 32, "context_tokens": 2000, "step_seconds": 0.0093}, ...],
     "transfer": [{"bytes": 285000000, "seconds": 0.012}, ...],
     "layout":   {"attention_kv_bytes_per_token": 65536, "deltanet_state_bytes_per_request": 153944064},
     "serving":  [{"prompt_tokens": 1024, "client_ttft_s": 0.52, "engine_s": 0.50}, ...],
     "host_cpu": {"engine_cores": 2, "rows": [{"tokens_per_s": 140.0, "busy_cores": 0.2}, ...]}}

Prefill rows: one pass over a batch of `batch_tokens` prompt tokens whose longest prompt has
`prompt_tokens`. Decode rows: one step of `batch_size` sequences whose mean context is
`context_tokens`. Transfer rows: one prefill -> decode handoff of `bytes`. Serving rows
(optional): one isolated request sent through gRPC, its client-side time to first token and
the part of it the engines spent (prefill, plus the handoff where decode makes the first
token). Host CPU rows (optional, CPU engines only): while decode streams run, how many cores
the host kept busy outside the engine processes, against the tokens streamed per second;
`engine_cores` is how many cores the engines are pinned to.

Three fits, all least squares with non-negative coefficients:
- prefill:  seconds = fixed + per_token x T + per_pair x S, T the batch's tokens and S the
  sum of squared prompt lengths (attention: every token against every earlier one). The probe
  gives only the longest prompt, so S is taken as prompt_tokens x batch_tokens (exact when a
  batch's prompts are equal, an upper bound otherwise).
- decode:   step = fixed + per_sequence x B + per_context_token x (B x C)
                   + compute_per_sequence x max(0, B - knee)
  Below the knee a step streams the weights once whatever the batch (memory-bound, nearly
  flat); past it the matmuls saturate the tensor cores and each sequence adds compute time.
  The knee is found by search: the fit with the least squared error over candidate knees.
- transfer: seconds = latency + bytes / bytes_per_s.
- serving path: the median of client_ttft - engine_s, a fixed cost per request (gRPC,
  routing, the feeds) that delays what the client sees but occupies no engine; 0 when the
  probe has no serving rows.
- host contention (CPU engines): busy cores outside the engines = background + CPU per
  token x tokens/s; engines then run 1 / (1 - that / engine cores) slower.

The fitted model saves to / loads from JSON, so it is fitted where the probe ran and used
anywhere (the simulator needs no GPU).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

# Seeds (README worked example): Qwen3.5-27B on 4xH100, batch 1.
SEEDS_PREFILL_TOKENS_PER_S = 3288.0
SEEDS_DECODE_TOKENS_PER_S = 108.0
SEEDS_DECODE_KNEE = 32.0
# Not in the seeds, stated assumptions: 4 x 3.35 TB/s HBM (H100 SXM) for the per-sequence and
# per-context-token reads; one 200 Gb/s NIC (25 GB/s) and 1 ms per handoff for transfer.
ASSUMED_HBM_BYTES_PER_S = 4 * 3.35e12
ASSUMED_NIC_BYTES_PER_S = 25e9
ASSUMED_TRANSFER_LATENCY_S = 1e-3
# bench/nixl_transfer.py's Qwen3.5-27B layout: 16 attention layers x 4 KiB per token, and
# 48 DeltaNet layers x (3 MiB temporal + 60 KiB conv) state per request.
QWEN35_27B_KV_BYTES_PER_TOKEN = 16 * 4096
QWEN35_27B_STATE_BYTES = 48 * (3 * 2**20 + 60 * 2**10)


@dataclass(frozen=True, slots=True)
class PrefillCost:
    fixed_s: float
    per_token_s: float
    per_token_pair_s: float  # times the sum of squared prompt lengths in the batch
    rms_relative_error: float = 0.0  # of the fit on the probe rows; 0 when not fitted

    def seconds(self, batch_tokens: float, squared_tokens: float) -> float:
        return self.fixed_s + self.per_token_s * batch_tokens + self.per_token_pair_s * squared_tokens


@dataclass(frozen=True, slots=True)
class DecodeCost:
    fixed_s: float  # weights streamed once per step
    per_sequence_s: float  # fixed-size per-sequence work: DeltaNet state read, sampling
    per_context_token_s: float  # attention KV read per cached token
    knee: float  # batch size past which a step is compute-bound
    compute_per_sequence_s: float  # extra time per sequence past the knee
    rms_relative_error: float = 0.0

    def seconds(self, batch_size: int, context_tokens: float) -> float:
        """One step; `context_tokens` is the batch's total context (sum over sequences)."""
        return (
            self.fixed_s
            + self.per_sequence_s * batch_size
            + self.per_context_token_s * context_tokens
            + self.compute_per_sequence_s * max(0.0, batch_size - self.knee)
        )


@dataclass(frozen=True, slots=True)
class TransferCost:
    latency_s: float
    bytes_per_s: float
    rms_relative_error: float = 0.0

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class HostContention:
    """CPU serving only: engines share the host's cores with the serving stack (router, gRPC,
    Ray, clients on the box). What that stack burns, a fixed part plus a part per streamed
    token, is time the engines' cores lose, so every engine action runs slower by
    1 / (1 - demand / cores). GPU engines do not lose accelerator time to it: no contention."""

    cores: int
    background_cores: float  # busy cores outside the engines with nothing streaming
    cpu_s_per_token: float  # CPU seconds outside the engines per streamed token

    def slowdown(self, tokens_per_s: float) -> float:
        demand = (self.background_cores + self.cpu_s_per_token * tokens_per_s) / self.cores
        return 1 / (1 - min(demand, 0.9))  # capped: past it the host is simply overloaded


@dataclass(frozen=True, slots=True)
class Layout:
    attention_kv_bytes_per_token: int
    deltanet_state_bytes_per_request: int

    def transfer_bytes(self, prompt_tokens: int) -> int:
        return prompt_tokens * self.attention_kv_bytes_per_token + self.deltanet_state_bytes_per_request


@dataclass(frozen=True, slots=True)
class PerformanceModel:
    hardware: str
    model: str
    prefill: PrefillCost
    decode: DecodeCost
    transfer: TransferCost
    layout: Layout
    serving_overhead_s: float = 0.0  # per request, outside the engines (gRPC, router, Ray)
    host: HostContention | None = None  # CPU engines sharing cores with the serving stack
    # GPUs (CPU: core sets) per engine the figures are for: prefill TP, decode TP.
    tensor_parallel: tuple[int, int] = (1, 1)

    def transfer_seconds(self, prompt_tokens: int) -> float:
        return self.transfer.seconds(self.layout.transfer_bytes(prompt_tokens))

    def local_prefill_limit(self, most: int = 1 << 20) -> int:
        """The most prompt tokens a decode engine missing them should compute itself rather
        than take a handoff (RouterPolicy.local_prefill_uncached): where their prefill costs no
        more than moving them and the state would. The pass's fixed cost is left out, as the
        tokens ride along a decode step the engine runs anyway."""
        p = self.prefill

        def local_wins(tokens: int) -> bool:
            computing = p.per_token_s * tokens + p.per_token_pair_s * tokens * tokens
            return computing <= self.transfer_seconds(tokens)

        low, high = 0, most  # local_wins(low) holds (0 <= the transfer's latency)
        if local_wins(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if local_wins(middle) else (low, middle)
        return low

    def scaled(self, prefill: float = 1.0, decode: float = 1.0) -> PerformanceModel:
        """This model with every prefill time x `prefill` and every decode step x `decode` (the
        knee stays): the closed-loop planner's correction for observed against predicted
        latency. Transfer and the serving path are left alone: no router measurement isolates them."""
        if prefill <= 0 or decode <= 0:
            raise ValueError(f"scale factors must be positive, got prefill {prefill}, decode {decode}")
        p, d = self.prefill, self.decode
        return replace(
            self,
            prefill=replace(
                p,
                fixed_s=p.fixed_s * prefill,
                per_token_s=p.per_token_s * prefill,
                per_token_pair_s=p.per_token_pair_s * prefill,
            ),
            decode=replace(
                d,
                fixed_s=d.fixed_s * decode,
                per_sequence_s=d.per_sequence_s * decode,
                per_context_token_s=d.per_context_token_s * decode,
                compute_per_sequence_s=d.compute_per_sequence_s * decode,
            ),
        )

    @classmethod
    def from_probe(cls, probe: dict[str, Any], transfer: TransferCost | None = None) -> PerformanceModel:
        """`transfer` replaces the fit of the probe's transfer rows when given."""
        return cls(
            hardware=probe["hardware"],
            model=probe["model"],
            prefill=fit_prefill(probe["prefill"]),
            decode=fit_decode(probe["decode"]),
            transfer=transfer or fit_transfer(probe["transfer"]),
            layout=Layout(**probe["layout"]),
            serving_overhead_s=fit_serving(probe.get("serving", [])),
            host=fit_host(probe.get("host_cpu")),
            tensor_parallel=_probed_tp(probe),
        )

    @classmethod
    def seeds_example(cls) -> PerformanceModel:
        """Qwen3.5-27B on one 4xH100 instance from the seeds' headline figures: prefill 3,288
        tok/s, decode 108 tok/s at batch 1, compute-bound past batch ~32."""
        step = 1 / SEEDS_DECODE_TOKENS_PER_S
        layout = Layout(QWEN35_27B_KV_BYTES_PER_TOKEN, QWEN35_27B_STATE_BYTES)
        return cls(
            hardware="4xH100",
            model="Qwen3.5-27B (seeds' figures)",
            prefill=PrefillCost(0.0, 1 / SEEDS_PREFILL_TOKENS_PER_S, 0.0),
            decode=DecodeCost(
                fixed_s=step,
                per_sequence_s=layout.deltanet_state_bytes_per_request / ASSUMED_HBM_BYTES_PER_S,
                per_context_token_s=layout.attention_kv_bytes_per_token / ASSUMED_HBM_BYTES_PER_S,
                knee=SEEDS_DECODE_KNEE,
                # Roofline: at the knee compute time equals the weight-read time, and grows
                # linearly with the batch past it.
                compute_per_sequence_s=step / SEEDS_DECODE_KNEE,
            ),
            transfer=TransferCost(ASSUMED_TRANSFER_LATENCY_S, ASSUMED_NIC_BYTES_PER_S),
            layout=layout,
            tensor_parallel=(4, 4),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PerformanceModel:
        return cls(
            hardware=data["hardware"],
            model=data["model"],
            prefill=PrefillCost(**data["prefill"]),
            decode=DecodeCost(**data["decode"]),
            transfer=TransferCost(**data["transfer"]),
            layout=Layout(**data["layout"]),
            # Models saved before these existed have neither.
            serving_overhead_s=data.get("serving_overhead_s", 0.0),
            host=HostContention(**data["host"]) if data.get("host") else None,
            tensor_parallel=tuple(data.get("tensor_parallel", (1, 1))),
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> PerformanceModel:
        return cls.from_dict(json.loads(path.read_text()))


def _probed_tp(probe: dict[str, Any]) -> tuple[int, int]:
    engines = probe.get("engines") or {}  # probes written before TP existed ran TP 1
    return int(engines.get("prefill_tp", 1)), int(engines.get("decode_tp", 1))


def load_probe(path: Path) -> PerformanceModel:
    return PerformanceModel.from_probe(json.loads(path.read_text()))


# --- fitting ---------------------------------------------------------------------------


def nonnegative_least_squares(features: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """min |A x - y|^2 subject to x >= 0, and its squared error. Exact for the few columns
    used here: the optimum is the unconstrained fit on some subset of columns (the positive
    ones), so try every subset and keep the best feasible fit."""
    # Scale columns to unit norm: token counts squared reach 1e9 next to a column of ones.
    norms = np.linalg.norm(features, axis=0)
    norms[norms == 0] = 1.0
    scaled = features / norms
    best = np.zeros(features.shape[1])
    best_error = float(target @ target)
    for size in range(1, features.shape[1] + 1):
        for columns in itertools.combinations(range(features.shape[1]), size):
            picked = list(columns)
            solution = np.linalg.lstsq(scaled[:, picked], target, rcond=None)[0]
            if (solution < 0).any():
                continue
            residual = target - scaled[:, picked] @ solution
            error = float(residual @ residual)
            if error < best_error:
                best_error = error
                best = np.zeros(features.shape[1])
                best[picked] = solution
    return best / norms, best_error


def _relative_rms(features: np.ndarray, coefficients: np.ndarray, target: np.ndarray) -> float:
    relative = (features @ coefficients - target) / target
    return float(np.sqrt(np.mean(relative**2)))


def _rows(rows: list[dict[str, Any]], keys: tuple[str, ...], what: str, minimum: int) -> np.ndarray:
    if len(rows) < minimum:
        raise ValueError(f"probe has {len(rows)} {what} rows; the fit needs at least {minimum}")
    table = np.array([[float(row[key]) for key in keys] for row in rows])
    if (table <= 0).any():
        raise ValueError(f"probe {what} rows need positive {', '.join(keys)}")
    return table


def fit_prefill(rows: list[dict[str, Any]]) -> PrefillCost:
    table = _rows(rows, ("prompt_tokens", "batch_tokens", "seconds"), "prefill", 3)
    prompt, batch, seconds = table.T
    features = np.column_stack([np.ones_like(batch), batch, prompt * batch])
    coefficients, _ = nonnegative_least_squares(features, seconds)
    return PrefillCost(*coefficients, rms_relative_error=_relative_rms(features, coefficients, seconds))


def _decode_features(batch: np.ndarray, context: np.ndarray, knee: float) -> np.ndarray:
    return np.column_stack([np.ones_like(batch), batch, batch * context, np.maximum(0.0, batch - knee)])


def fit_decode(rows: list[dict[str, Any]]) -> DecodeCost:
    """Probe batches on both sides of the knee; with none past it the compute term is 0 and
    the model extrapolates an optimistic flat step to larger batches."""
    table = _rows(rows, ("batch_size", "context_tokens", "step_seconds"), "decode", 4)
    batch, context, seconds = table.T
    fits = []
    for knee in range(int(batch.min()), int(batch.max()) + 1):
        coefficients, error = nonnegative_least_squares(_decode_features(batch, context, knee), seconds)
        fits.append((error, knee, coefficients))
    _, knee, coefficients = min(fits, key=lambda fit: fit[0])
    fixed, per_sequence, per_context, compute = coefficients
    return DecodeCost(
        fixed,
        per_sequence,
        per_context,
        float(knee),
        compute,
        rms_relative_error=_relative_rms(_decode_features(batch, context, knee), coefficients, seconds),
    )


def fit_transfer(rows: list[dict[str, Any]]) -> TransferCost:
    table = _rows(rows, ("bytes", "seconds"), "transfer", 2)
    num_bytes, seconds = table.T
    features = np.column_stack([np.ones_like(num_bytes), num_bytes])
    (latency, per_byte), _ = nonnegative_least_squares(features, seconds)
    if per_byte <= 0:
        raise ValueError("transfer rows show no growth with bytes: probe a wider range of sizes")
    return TransferCost(latency, 1 / per_byte, _relative_rms(features, np.array([latency, per_byte]), seconds))


def fit_serving(rows: list[dict[str, Any]]) -> float:
    """Median, not mean: one request stalled by something else on the host is not the path's cost."""
    if not rows:
        return 0.0
    return max(0.0, float(np.median([row["client_ttft_s"] - row["engine_s"] for row in rows])))


def fit_host(host_cpu: dict[str, Any] | None) -> HostContention | None:
    """busy cores outside the engines = background + CPU per token x tokens/s, least squares."""
    if not host_cpu:
        return None
    table = _rows(host_cpu["rows"], ("tokens_per_s", "busy_cores"), "host CPU", 2)
    tokens_per_s, busy = table.T
    (background, per_token), _ = nonnegative_least_squares(np.column_stack([np.ones_like(busy), tokens_per_s]), busy)
    return HostContention(int(host_cpu["engine_cores"]), float(background), float(per_token))
