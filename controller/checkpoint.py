"""What a restarted controller needs to take over its running engines, kept in Ray's GCS.

The controller's engines are detached actors, so they outlive a controller that is killed;
Ray restarts the controller, and the new one reads these records to adopt them instead of
starting new engines. Ray Serve's controller recovers the same way: a checkpoint in the
GCS's key-value store, which lives as long as the cluster.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ray.experimental import internal_kv

_NAMESPACE = "pdserve"


@dataclass(frozen=True, slots=True)
class PoolRecord:
    """The pools' members by engine name, and the counters new engines' names and CPU cores
    continue from."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    next_index: tuple[tuple[str, int], ...]  # (name kind, next number): names are never reused
    next_core: int


@dataclass(frozen=True, slots=True)
class GcsRecord:
    """One JSON record under `key`, written whole each time."""

    key: str

    def save(self, value: object) -> None:
        internal_kv._internal_kv_put(self.key, json.dumps(value), overwrite=True, namespace=_NAMESPACE)

    def load(self) -> object | None:
        raw = internal_kv._internal_kv_get(self.key, namespace=_NAMESPACE)
        return None if raw is None else json.loads(raw)

    def remove(self) -> None:
        internal_kv._internal_kv_del(self.key, namespace=_NAMESPACE)


def save_pools(record: GcsRecord, pools: PoolRecord) -> None:
    record.save(asdict(pools))


def load_pools(record: GcsRecord) -> PoolRecord | None:
    raw = record.load()
    if not isinstance(raw, dict):
        return None
    return PoolRecord(
        tuple(raw["prefill"]),
        tuple(raw["decode"]),
        tuple((kind, int(n)) for kind, n in raw["next_index"]),
        int(raw["next_core"]),
    )
