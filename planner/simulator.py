"""Discrete-event simulation of a pdserve deployment, timed by a fitted PerformanceModel.

Disaggregated (`Split(prefill=N, decode=M)`):
- router: each arriving prompt goes to the prefill instance with the fewest outstanding
  prompt tokens (waiting + in the running batch), as pdserve's router does;
- prefill instance: FCFS; when free it takes the waiting prompts in arrival order up to a
  token budget (at least one) and runs them as one batch;
- transfer: attention KV (bytes per token x prompt) + fixed DeltaNet state per request,
  timed by the model; a pure delay (links are not shared);
- first token: as in pdserve on hybrids, prefill samples it, so TTFT ends with the prefill
  batch; a one-token answer never reaches decode;
- decode instance (the one with the fewest running + waiting requests when the state lands):
  continuous batching; at every step boundary waiting requests join up to the batch limit
  (context prompt + 1), and every running sequence gets one token per step.

Colocated (`Split(prefill=0, decode=N)`): N instances doing both, routed by fewest
running + waiting requests. At a step boundary waiting prompts are prefilled first (vLLM's
priority; the running decodes stall meanwhile) while there is room under the batch limit;
the prefill samples the first token.

The serving path's fixed cost (model.serving_overhead_s: gRPC, routing, the feeds) delays
every token the client sees by the same amount; it occupies no engine, so it adds to TTFT
and end-to-end time and leaves inter-token times alone.

On CPU engines that share the host with the serving stack (model.host), every prefill and
decode step is stretched by the slowdown at the workload's offered token rate (rate x mean
output tokens): a steady-state approximation, not a per-instant one.

Time only moves forward per instance: each instance advances lazily to the time of the next
request routed anywhere (no global event queue), so a decode step costs a few Python
operations and no heap traffic.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from configuration.fields import knob
from messages.timings import SLO, LatencySummary
from planner.model import DecodeCost, PerformanceModel, PrefillCost
from planner.trace import parse_trace

DEFAULT_TOKEN_BUDGET = 8192  # vLLM's usual max_num_batched_tokens when serving on large GPUs
DEFAULT_BATCH_LIMIT = 64


@dataclass(frozen=True, slots=True)
class Split:
    prefill: int  # instances; 0 = colocated
    decode: int  # instances (colocated: all of them)
    batch_limit: int = DEFAULT_BATCH_LIMIT  # running sequences per decode (or colocated) instance
    token_budget: int = DEFAULT_TOKEN_BUDGET  # prompt tokens per prefill batch

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 1 or self.batch_limit < 1 or self.token_budget < 1:
            raise ValueError(f"invalid split {self}")

    @property
    def instances(self) -> int:
        return self.prefill + self.decode

    @property
    def colocated(self) -> bool:
        return self.prefill == 0

    @property
    def label(self) -> str:
        return f"{self.decode} colocated" if self.colocated else f"{self.prefill}P:{self.decode}D"


# --- workload --------------------------------------------------------------------------


LengthShape = Literal["uniform", "lognormal"]


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token counts around `mean`: `uniform` in mean x (1 +- spread), or `lognormal` with
    sigma = spread (and that mean); spread 0 gives exactly `mean`."""

    mean: float
    spread: float = 0.0
    shape: LengthShape = "uniform"

    def __post_init__(self) -> None:
        if self.mean < 1 or self.spread < 0 or (self.shape == "uniform" and self.spread > 1):
            raise ValueError(f"invalid lengths {self}: mean >= 1, spread >= 0 (uniform: <= 1)")

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        if self.shape == "uniform":
            values = self.mean * rng.uniform(1 - self.spread, 1 + self.spread, count)
        else:
            values = rng.lognormal(math.log(self.mean) - self.spread**2 / 2, self.spread, count)
        return np.maximum(1, np.rint(values)).astype(np.int64)


def _unit_poisson(rng: np.random.Generator, count: int) -> np.ndarray:
    """A Poisson process conditioned on `count` arrivals in [0, count): sorted uniforms (as
    bench.loadgen does), so the realised rate is the nominal one."""
    return np.sort(rng.uniform(0.0, count, count))


@dataclass(frozen=True, slots=True, eq=False)
class Workload:
    """Requests with arrival times at a mean rate of 1 req/s; `arrivals(rate)` rescales them,
    so runs at different rates see the same requests in the same pattern (common random
    numbers: goodput found by bisection on the rate is then stable)."""

    unit_arrivals: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    native_rate: float | None = None  # a trace's own mean rate
    # Of each prompt, the tokens a prefix cache serves (RAG documents, system prompts, earlier
    # turns): prefill computes only the rest. None: nothing cached.
    cached_tokens: np.ndarray | None = None

    @property
    def uncached_tokens(self) -> np.ndarray:
        """Of each prompt, the tokens prefill computes."""
        return self.prompt_tokens if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens

    def with_cached_share(self, share: float) -> Workload:
        """This workload with `share` of every prompt cached (at least one token is computed)."""
        if not 0 <= share < 1:
            raise ValueError(f"a cached share is in [0, 1), got {share}")
        cached = np.minimum(np.floor(self.prompt_tokens * share), self.prompt_tokens - 1).astype(np.int64)
        return replace(self, cached_tokens=np.maximum(cached, 0))

    @classmethod
    def poisson(cls, count: int, prompt: Lengths, output: Lengths, seed: int = 0) -> Workload:
        rng = np.random.default_rng(seed)
        arrivals = _unit_poisson(rng, count)
        return cls(arrivals, prompt.sample(rng, count), output.sample(rng, count))

    @classmethod
    def resample(
        cls,
        prompt_tokens: np.ndarray,
        output_tokens: np.ndarray,
        count: int,
        seed: int = 0,
        cached_tokens: np.ndarray | None = None,
    ) -> Workload:
        """`count` Poisson arrivals whose (prompt, output[, cached]) rows are drawn with
        replacement from observed ones: an empirical length mix, the correlation between the
        lengths (and a request's prefix hit) kept."""
        if len(prompt_tokens) != len(output_tokens) or not len(prompt_tokens):
            raise ValueError("resample needs as many prompt as output lengths, and at least one pair")
        rng = np.random.default_rng(seed)
        arrivals = _unit_poisson(rng, count)
        picks = rng.integers(0, len(prompt_tokens), count)
        prompt, output = (np.asarray(tokens, dtype=np.int64)[picks] for tokens in (prompt_tokens, output_tokens))
        cached = None if cached_tokens is None else np.asarray(cached_tokens, dtype=np.int64)[picks]
        return cls(arrivals, prompt, output, cached_tokens=cached)

    @classmethod
    def trace(cls, rows: Iterable[tuple[float, int, int]]) -> Workload:
        """(arrival_s, prompt_tokens, output_tokens) rows; rescaled to any rate, the trace's
        burst pattern is kept and only compressed or stretched."""
        table = np.array(sorted(rows), dtype=float)
        if len(table) < 2:
            raise ValueError("a trace needs at least two requests")
        arrivals = table[:, 0] - table[0, 0]
        if arrivals[-1] <= 0:
            raise ValueError("a trace's arrivals must span some time")
        native = len(table) / arrivals[-1]
        return cls(arrivals * native, table[:, 1].astype(np.int64), table[:, 2].astype(np.int64), native)

    def __len__(self) -> int:
        return len(self.unit_arrivals)

    def arrivals(self, rate: float) -> np.ndarray:
        if rate <= 0:
            raise ValueError("rate must be positive")
        return self.unit_arrivals / rate


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The requests a search simulates: Poisson arrivals with lengths around two means, or a trace."""

    prompt_tokens: float = knob(1000.0, help="mean prompt length")
    output_tokens: float = knob(50.0, help="mean output length")
    length_spread: float = knob(0.2, help="uniform: +-fraction; lognormal: sigma")
    length_shape: LengthShape = knob("uniform", help="how lengths spread around their means")
    requests: int = knob(600, help="requests per simulation (of a trace: its first ones)")
    seed: int = knob(0, help="of the Poisson arrivals and lengths")
    trace: str | None = knob(None, help="JSONL rows {arrival_s, prompt_tokens, output_tokens} (planner.trace)")
    cached_share: float = knob(
        0.0, help="share of each prompt served from a prefix cache (RAG documents, system prompts, earlier turns)"
    )

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.length_spread < 0 or (self.length_shape == "uniform" and self.length_spread > 1):
            raise ValueError(f"length_spread must be >= 0 (uniform: <= 1), got {self.length_spread}")
        if self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if not 0 <= self.cached_share < 1:
            raise ValueError(f"cached_share must be in [0, 1), got {self.cached_share}")

    def build(self) -> Workload:
        if self.trace:
            with open(self.trace) as rows:
                specs = parse_trace(rows)[: self.requests]
            workload = Workload.trace((s.arrival_s, s.prompt_tokens, s.output_tokens) for s in specs)
        else:
            prompt = Lengths(self.prompt_tokens, self.length_spread, self.length_shape)
            output = Lengths(self.output_tokens, self.length_spread, self.length_shape)
            workload = Workload.poisson(self.requests, prompt, output, self.seed)
        return workload.with_cached_share(self.cached_share) if self.cached_share else workload


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Summary:
    rate: float  # offered, req/s
    requests: int
    duration_s: float  # first arrival -> last token
    throughput_rps: float
    output_tokens_per_s: float
    ttft_s: LatencySummary
    tpot_s: LatencySummary  # per request mean inter-token time
    e2e_s: LatencySummary
    peak_batch: int
    attainment: float  # fraction meeting both SLOs
    goodput_rps: float  # requests meeting both SLOs per second of the run


@dataclass(frozen=True, slots=True, eq=False)
class Timeline:
    """Per-request times in seconds from the start of the run."""

    arrival: np.ndarray
    prefill_start: np.ndarray
    first_token: np.ndarray
    last_token: np.ndarray
    output_tokens: np.ndarray
    peak_batch: int  # most sequences in one decode step on any instance

    @property
    def ttft(self) -> np.ndarray:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        """Mean inter-token time; 0 for single-token outputs (nothing to be late for)."""
        gaps = np.maximum(self.output_tokens - 1, 1)
        return (self.last_token - self.first_token) / gaps

    @property
    def e2e(self) -> np.ndarray:
        return self.last_token - self.arrival

    def meets(self, slo: SLO) -> np.ndarray:
        if slo.itl_stat != "mean":
            raise ValueError("the simulator judges a request's mean inter-token time (TPOT): use itl_stat 'mean'")
        return (self.ttft <= slo.ttft_s) & (self.tpot <= slo.itl_s)

    def summary(self, rate: float, slo: SLO) -> Summary:
        duration = float(self.last_token.max() - self.arrival.min())
        good = int(self.meets(slo).sum())
        return Summary(
            rate=rate,
            requests=len(self.arrival),
            duration_s=duration,
            throughput_rps=len(self.arrival) / duration,
            output_tokens_per_s=float(self.output_tokens.sum()) / duration,
            ttft_s=LatencySummary.of(self.ttft),
            tpot_s=LatencySummary.of(self.tpot),
            e2e_s=LatencySummary.of(self.e2e),
            peak_batch=self.peak_batch,
            attainment=good / len(self.arrival),
            goodput_rps=good / duration,
        )


# --- instances -------------------------------------------------------------------------


class _Requests:
    """Per-request state shared by all instances, as lists (faster than numpy scalars)."""

    __slots__ = ("arrival", "first", "last", "output", "prefill_end", "prefill_start", "prompt", "uncached")

    def __init__(self, workload: Workload, rate: float) -> None:
        self.arrival: list[float] = workload.arrivals(rate).tolist()
        self.prompt: list[int] = workload.prompt_tokens.tolist()
        self.uncached: list[int] = workload.uncached_tokens.tolist()
        self.output: list[int] = workload.output_tokens.tolist()
        count = len(workload)
        self.prefill_start = [0.0] * count
        self.prefill_end = [0.0] * count
        self.first = [0.0] * count
        self.last = [0.0] * count

    def timeline(self, decode_pool: Sequence[_DecodeInstance], serving_overhead_s: float) -> Timeline:
        return Timeline(
            np.array(self.arrival),
            np.array(self.prefill_start),
            np.array(self.first) + serving_overhead_s,
            np.array(self.last) + serving_overhead_s,
            np.array(self.output),
            max(instance.peak_batch for instance in decode_pool),
        )


class _Instance:
    """One engine. Invariant: every waiting request arrived by `clock` (the end of the action
    in progress, or the time it went idle), because requests are added only after the
    instance has been advanced to their arrival."""

    def __init__(self, requests: _Requests, model: PerformanceModel, split: Split, slowdown: float) -> None:
        self.requests = requests
        self.slowdown = slowdown
        self.prefill_cost: PrefillCost = model.prefill
        self.token_budget = split.token_budget
        self.clock = 0.0
        self.waiting: deque[int] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def load(self, now: float) -> float:
        raise NotImplementedError

    def act(self) -> None:
        """Run the next action from `clock`, moving `clock` to its end."""
        raise NotImplementedError

    def advance(self, now: float) -> None:
        """Run every action that starts before `now` (one starting at `now` waits: requests
        arriving at that instant join it)."""
        while self.busy and self.clock < now:
            self.act()

    def add(self, rid: int, now: float) -> None:
        if not self.busy:
            self.clock = max(self.clock, now)
        self.waiting.append(rid)

    def prefill_batch(self, max_requests: int) -> list[int]:
        """Prefill waiting prompts in order up to the token budget (at least one). A prompt
        computes its uncached tokens, each against its whole context (the pair term)."""
        prompt, uncached = self.requests.prompt, self.requests.uncached
        batch = [self.waiting.popleft()]
        tokens = uncached[batch[0]]
        while self.waiting and len(batch) < max_requests and tokens + uncached[self.waiting[0]] <= self.token_budget:
            batch.append(self.waiting.popleft())
            tokens += uncached[batch[-1]]
        start = self.clock
        pairs = sum(uncached[rid] * prompt[rid] for rid in batch)
        self.clock += self.slowdown * self.prefill_cost.seconds(tokens, pairs)
        for rid in batch:
            self.requests.prefill_start[rid] = start
            self.requests.prefill_end[rid] = self.clock
        return batch


class _PrefillInstance(_Instance):
    def __init__(self, requests: _Requests, model: PerformanceModel, split: Split, slowdown: float) -> None:
        super().__init__(requests, model, split, slowdown)
        self.queued_tokens = 0
        self.running_tokens = 0  # in the batch that ends at `clock`

    def load(self, now: float) -> float:
        return self.queued_tokens + (self.running_tokens if self.clock > now else 0)

    def add(self, rid: int, now: float) -> None:
        super().add(rid, now)
        self.queued_tokens += self.requests.uncached[rid]

    def act(self) -> None:
        batch = self.prefill_batch(len(self.waiting))
        self.running_tokens = sum(self.requests.uncached[rid] for rid in batch)
        self.queued_tokens -= self.running_tokens
        for rid in batch:  # prefill samples the first token
            self.requests.first[rid] = self.requests.last[rid] = self.clock


class _DecodeInstance(_Instance):
    """Continuous batching. A sequence's context grows by one token per step, so the batch's
    total context is sum(context at join - step at join) + batch size x steps, kept as one
    running sum instead of per-sequence counters."""

    def __init__(self, requests: _Requests, model: PerformanceModel, split: Split, slowdown: float) -> None:
        super().__init__(requests, model, split, slowdown)
        self.decode_cost: DecodeCost = model.decode
        self.limit = split.batch_limit
        self.steps = 0
        self.running: list[tuple[int, int, int]] = []  # heap of (finishing step, rid, context term)
        self.context_terms = 0
        self.peak_batch = 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self, now: float) -> float:
        return len(self.running) + len(self.waiting)

    def act(self) -> None:
        while self.waiting and len(self.running) < self.limit:
            rid = self.waiting.popleft()
            self.join(rid, self.requests.prompt[rid] + 1, self.requests.output[rid] - 1)
        self.step()

    def join(self, rid: int, context: int, tokens: int) -> None:
        term = context - self.steps
        heapq.heappush(self.running, (self.steps + tokens, rid, term))
        self.context_terms += term

    def step(self) -> None:
        batch = len(self.running)
        self.peak_batch = max(self.peak_batch, batch)
        self.clock += self.slowdown * self.decode_cost.seconds(batch, self.context_terms + batch * self.steps)
        self.steps += 1
        while self.running and self.running[0][0] == self.steps:
            _, rid, term = heapq.heappop(self.running)
            self.context_terms -= term
            self.requests.last[rid] = self.clock


class _ColocatedInstance(_DecodeInstance):
    def act(self) -> None:
        room = self.limit - len(self.running)
        if not (self.waiting and room > 0):
            self.step()
            return
        for rid in self.prefill_batch(room):
            self.requests.first[rid] = self.clock
            if self.requests.output[rid] == 1:
                self.requests.last[rid] = self.clock
            else:
                self.join(rid, self.requests.prompt[rid] + 1, self.requests.output[rid] - 1)


def _dispatch(pool: Sequence[_Instance], order: Iterable[int], times: Sequence[float]) -> None:
    """Route requests (in time order) to the least-loaded instance, then drain the pool."""
    for rid in order:
        now = times[rid]
        for instance in pool:
            instance.advance(now)
        min(pool, key=lambda instance: instance.load(now)).add(rid, now)
    for instance in pool:
        instance.advance(math.inf)


def simulate(model: PerformanceModel, split: Split, workload: Workload, rate: float) -> Timeline:
    requests = _Requests(workload, rate)
    arrivals = range(len(workload))
    slowdown = model.host.slowdown(rate * float(workload.output_tokens.mean())) if model.host else 1.0
    if split.colocated:
        pool = [_ColocatedInstance(requests, model, split, slowdown) for _ in range(split.decode)]
        _dispatch(pool, arrivals, requests.arrival)
        return requests.timeline(pool, model.serving_overhead_s)
    prefill_pool = [_PrefillInstance(requests, model, split, slowdown) for _ in range(split.prefill)]
    _dispatch(prefill_pool, arrivals, requests.arrival)
    ready = [end + model.transfer_seconds(p) for end, p in zip(requests.prefill_end, requests.prompt)]
    decoded = [rid for rid in arrivals if requests.output[rid] > 1]
    decode_pool = [_DecodeInstance(requests, model, split, slowdown) for _ in range(split.decode)]
    _dispatch(decode_pool, sorted(decoded, key=ready.__getitem__), ready)
    return requests.timeline(decode_pool, model.serving_overhead_s)


def simulate_at(
    model: PerformanceModel,
    split: Split,
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    cached_tokens: np.ndarray | None = None,
) -> Timeline:
    """Requests at their own arrival times (seconds, sorted) on a cluster empty at the first
    arrival: an observed window replayed as it came. The timeline counts from that arrival."""
    arrival = np.asarray(arrival_s, dtype=float)
    if not len(arrival) or (np.diff(arrival) < 0).any():
        raise ValueError("simulate_at needs at least one request, arrival times sorted")
    span = float(arrival[-1] - arrival[0])
    # The offered rate (it sets CPU engines' host slowdown); any rate when all arrive at once.
    rate = len(arrival) / span if span > 0 else 1.0
    cached = None if cached_tokens is None else np.asarray(cached_tokens)
    prompt, output = np.asarray(prompt_tokens), np.asarray(output_tokens)
    workload = Workload((arrival - arrival[0]) * rate, prompt, output, cached_tokens=cached)
    return simulate(model, split, workload, rate)
