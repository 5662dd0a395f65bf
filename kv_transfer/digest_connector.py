"""vLLM's NixlConnector with transfer digests (kv_transfer.digests): the one connector every
pdserve engine loads (`kv_connector_module_path`); vLLM does all the moving.

Why a subclass: only the connector's worker half sees a pulled request between the READ
completing and the request running, and the only way to hand vLLM's scheduler a load it must
not use is the connector's `failed_recving`. What it adds:
- scheduler half: the producer's digests, which decode passes in the request's
  kv_transfer_params, ride to the workers in the step's connector metadata;
- worker half: remembers which local block each READ filled from which producer block
  (NixlConnector's own pairing, after its prefix-cache trim), and when a request's READs
  complete compares each local block's digest with the sum of its sources'. A mismatch
  reports the load failed: vLLM then recomputes the request on decode
  (`kv_load_failure_policy="recompute"`) or ends it for the router to migrate ("fail"). It is
  logged with the request and both engines, and counted in the connector statistics the
  engine's stat logger turns into `pdserve_handoff_integrity_failures_total{kind}`;
- producer side: `producer_digests`, called on every rank by the prefill worker
  (vllm_engine.worker_extension) while the finished request's blocks are held.

Transfers read through a block-size or region mapping, or under decode context parallelism,
go unchecked (counted as such): their pairing is not NixlConnector's plain one.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, NixlKVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_ssm_spec

from kv_transfer.digests import CHECKED, DIGESTS_KEY, FAILED, UNCHECKED, ZERO, Digest, block_digests, from_wire

log = logging.getLogger(__name__)

# What is kept for a request whose READ never completes here (aborted) is dropped oldest first.
_MAX_PENDING = 4096


def _bounded(pending: OrderedDict) -> OrderedDict:
    while len(pending) >= _MAX_PENDING:
        pending.popitem(last=False)
    return pending


class DigestStats(NixlKVConnectorStats):
    """NixlConnector's statistics plus the digest outcomes."""

    def reset(self) -> None:
        super().reset()
        self.data.update({CHECKED: [], UNCHECKED: [], **{field: [] for field in FAILED.values()}})

    def is_empty(self) -> bool:
        ours = (CHECKED, UNCHECKED, *FAILED.values())
        return super().is_empty() and not any(self.data.get(field) for field in ours)

    def aggregate(self, other: Any) -> Any:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self


@dataclass(frozen=True, slots=True)
class _Read:
    """One READ NixlConnector posted: per group, the local blocks it filled and the
    producer-rank blocks they came from, with that rank's whole block list (positions)."""

    remote_rank: int
    local: list[list[int]]
    remote: list[list[int]]
    offered: list[list[int]]


class DigestedNixlConnector(NixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._offered_digests: dict[str, Any] = {}  # scheduler half: this step's requests
        self._expected: OrderedDict[str, list[list[list[Digest]]]] = OrderedDict()  # worker half
        self._reads: OrderedDict[str, list[_Read]] = OrderedDict()
        self._reading = threading.local()
        self._caches: dict[str, Any] = {}
        worker = self.connector_worker
        if worker is not None:
            worker.xfer_stats = DigestStats()
            read, trim = worker._read_blocks, worker._apply_prefix_caching

            def recording_read(**kwargs: Any) -> bool:
                self._reading.now = (kwargs["request_id"], kwargs["read_spec"])
                try:
                    return read(**kwargs)
                finally:
                    self._reading.now = None

            def recording_trim(**kwargs: Any) -> tuple[Any, Any]:
                local, remote = trim(**kwargs)
                now = getattr(self._reading, "now", None)
                if now is not None:
                    request_id, spec = now
                    _bounded(self._reads).setdefault(request_id, []).append(
                        _Read(
                            spec.remote_rank,
                            [list(g) for g in local],
                            [list(g) for g in remote],
                            [list(g) for g in spec.remote_block_ids],
                        )
                    )
                return local, remote

            worker._read_blocks = recording_read
            worker._apply_prefix_caching = recording_trim

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DigestStats:
        return DigestStats(data=data) if data is not None else DigestStats()

    # ---- scheduler half -------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        digests = (request.kv_transfer_params or {}).get(DIGESTS_KEY)
        if digests is not None:
            self._offered_digests[request.request_id] = digests
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        # Allocation and this metadata happen in the same scheduling step: what is not
        # received this step never will be.
        offered, self._offered_digests = self._offered_digests, {}
        meta.pdserve_digests = {rid: offered[rid] for rid in meta.reqs_to_recv if rid in offered}
        return meta

    # ---- worker half ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._caches = kv_caches
        super().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        for request_id, wire in getattr(connector_metadata, "pdserve_digests", {}).items():
            _bounded(self._expected)[request_id] = from_wire(wire)

    def producer_digests(self, logical_block_ids: list[list[int]]) -> list[list[Digest]]:
        """This rank's digest of every block a finished request offers, per transfer group,
        in the order of its kernel block list (what a consumer's READ pairs positions with)."""
        worker = self.connector_worker
        kernel = worker._logical_to_kernel_block_ids(logical_block_ids, worker._physical_blocks_per_logical_kv_block)
        return [block_digests(self._group_caches(g), list(ids), worker.num_blocks) for g, ids in enumerate(kernel)]

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        stats = self.connector_worker.xfer_stats
        for request_id in results.finished_recving:
            expected = self._expected.pop(request_id, None)
            reads = self._reads.pop(request_id, [])
            if expected is None or request_id in results.failed_recving:
                continue
            try:
                mismatched = self._verify(expected, reads)
            except Exception:  # a check must never take the engine down: count it unchecked
                log.exception("transfer digest check of request %s failed to run", request_id)
                mismatched = None
            if mismatched is None:
                stats.data[UNCHECKED].append(request_id)
                continue
            stats.data[CHECKED].append(request_id)
            if mismatched:
                results.failed_recving.add(request_id)
                for kind in sorted(mismatched):
                    stats.data[FAILED[kind]].append(request_id)
                log.error(
                    "transfer digest mismatch: request %s read from %s into %s: %s differ from what the "
                    "producer held; discarding the pulled state (vLLM's kv_load_failure_policy decides: "
                    "recompute here or fail over)",
                    request_id,
                    reads[0].remote_rank if reads else "?",
                    self.engine_id,
                    ", ".join(f"{n} {kind} block(s)" for kind, n in sorted(mismatched.items())),
                )
        return results

    def _verify(self, expected: list[list[list[Digest]]], reads: list[_Read]) -> dict[str, int] | None:
        """Blocks whose digest differs from the sum of their sources', by kind; None where
        the READs cannot be checked (no plain pairing, or parts that do not add up)."""
        if not reads:
            return None
        worker = self.connector_worker
        sums: dict[tuple[int, int], Digest] = {}
        for read in reads:
            rank = expected[read.remote_rank] if read.remote_rank < len(expected) else None
            for g, (local, remote, offered) in enumerate(zip(read.local, read.remote, read.offered)):
                position = {block: i for i, block in enumerate(offered)}
                if rank is None or any(block not in position for block in remote) or len(local) != len(remote):
                    return None
                for block, source in zip(local, remote):
                    sums[(g, block)] = sums.get((g, block), ZERO) + rank[g][position[source]]
        mismatched: dict[str, int] = {}
        for g in sorted({g for g, _ in sums}):
            blocks = sorted(block for group, block in sums if group == g)
            actual = block_digests(self._group_caches(g), blocks, worker.num_blocks)
            for block, digest in zip(blocks, actual):
                whole = sums[(g, block)]
                if digest.nbytes != whole.nbytes or not (digest.aligned and whole.aligned):
                    return None  # replicated or sliced heads, or parts not of whole words
                if not digest.matches(whole):
                    kind = "state" if _is_ssm_spec(worker._group_spec_types[g]) else "attention"
                    mismatched[kind] = mismatched.get(kind, 0) + 1
        return mismatched

    def _group_caches(self, group: int) -> list[Any]:
        names = self.connector_worker.kv_cache_config.transfer_groups[group].layer_names
        return [self._caches[name] for name in names if name in self._caches]
