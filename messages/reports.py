"""What engines report to the router: their load (polled), their capacity (at start), how
their prefix indexes change (followed) and how much of a prompt a prefix cache holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    waiting: int  # queued, including requests waiting for remote KV
    held_for_transfer: int  # finished on this engine, blocks kept for a peer to read
    free_blocks: int
    total_blocks: int
    engine_id: str = ""  # filled in by the worker that owns the engine
    metrics_address: str = ""  # the worker's Prometheus endpoint (changes when Ray restarts it)
    # Wall-clock time (time.time()) the worker measured this: on an engine without their feed
    # (prefill), routers count their own requests started or finished after it on top
    # (cluster.pools.Member.estimated_requests).
    measured_at: float = 0.0
    # A decode engine's requests by the router feed that started them (decode_worker.feed):
    # a router tells its own from the others' exactly, whenever each reached the engine.
    requests_by_feed: tuple[tuple[str, int], ...] = ()

    def requests_from(self, feed: str) -> int:
        """Requests started through `feed` (its legs: each is counted here from its arrival,
        in `running` or `waiting` only once the engine has taken it, at its next step)."""
        return next((count for name, count in self.requests_by_feed if name == feed), 0)

    def requests_from_others(self, feed: str) -> int:
        """Requests the other routers' feeds started here, by the same count."""
        return sum(count for name, count in self.requests_by_feed if name != feed)


@dataclass(frozen=True, slots=True)
class EngineCapacity:
    """Reported by each engine at start-up (per rank pool; every rank holds the same blocks)."""

    kv_blocks: int  # blocks in the pool, shared by attention blocks and DeltaNet state slots
    deltanet_state_slots: int  # 0 for attention-only models
    blocks_per_max_length_request: int
    max_concurrent_max_length_requests: int  # also bounded by max_num_seqs
    max_num_seqs: int  # the engine's batch limit
    max_model_len: int
    tensor_parallel_size: int
    block_size: int  # attention tokens per block, as vLLM picked it
    prefix_caching: bool
    niceness: int = 0  # the engine process's (Ray starts workers at 15 unless told otherwise)
    bf16_without_cpu_support: bool = False  # vllm_engine.sizing.bf16_without_cpu_support

    @property
    def reuse(self) -> str:
        """The granularity at which a cached prefix is reused here."""
        if not self.prefix_caching:
            return "prefix caching off"
        if self.deltanet_state_slots:  # vLLM's align mode: state checkpoints at block ends
            return (
                f"prefix caching on: whole {self.block_size}-token blocks, up to the last block end "
                "where a DeltaNet state checkpoint was kept"
            )
        return f"prefix caching on: whole {self.block_size}-token blocks"

    def summary(self) -> str:
        return (
            f"TP {self.tensor_parallel_size}, {self.kv_blocks:,} KV blocks of {self.block_size} tokens "
            f"(shared with DeltaNet state slots), {self.blocks_per_max_length_request} per "
            f"{self.max_model_len:,}-token request: {self.max_concurrent_max_length_requests} concurrent "
            f"max-length requests; {self.reuse}"
        ) + (
            f"; WARNING: runs at nice {self.niceness}, so anything busy on its node (Ray's own daemons after a "
            "node is lost, say) starves it: start every raylet with RAY_worker_niceness=0, as deploy/ does"
            if self.niceness > 0
            else ""
        ) + (
            "; WARNING: computes in bfloat16 on a CPU without AVX512-BF16 or AMX, where vLLM's kernels take "
            "much slower paths (docs/benchmarks.md): serve on a CPU that has them, or, for a model without "
            "Gated DeltaNet (vLLM's CPU kernel for it is bf16 only), --dtype float32"
            if self.bf16_without_cpu_support
            else ""
        )


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """How much of one prompt an engine's prefix cache holds.

    `tokens` it would reuse now. `attention_tokens` (>= tokens) it holds the attention blocks
    of: on a hybrid they exceed `tokens` where no DeltaNet state checkpoint was kept at their
    end. Such an engine computes the prompt now but keeps a checkpoint there (vLLM's
    shared-prefix junction), so the next prompt sharing that prefix hits on it and nowhere else.
    """

    tokens: int = 0
    attention_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tokens <= self.attention_tokens:
            raise ValueError(f"need 0 <= tokens <= attention_tokens, got {self.tokens} and {self.attention_tokens}")


# A block's hash as vLLM's KV cache events carry it: the low 64 bits as an int by default
# (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), else the whole digest.
BlockKey = bytes | int


@dataclass(frozen=True, slots=True)
class IndexChange:
    """Blocks one KV-cache group (vLLM's group index) stored, or evicted (`stored` False)."""

    group: int
    stored: bool
    keys: tuple[BlockKey, ...]


@dataclass(frozen=True, slots=True)
class PrefixIndexUpdate:
    """How an engine's prefix index changed past `version` of its `generation`, in order; or,
    `whole`, everything it holds, for a copy that starts again (a new router, an engine that
    restarted or whose index started again, a copy further behind than the engine keeps)."""

    generation: str
    version: int  # after these changes
    whole: bool
    changes: tuple[IndexChange, ...]
