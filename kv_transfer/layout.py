"""What one request's transferable state weighs, derived from the engine's KV-cache layout.

vLLM splits a hybrid model's cache into KV-cache groups: attention groups whose blocks hold
`block_size` tokens each, and Mamba/Gated-DeltaNet groups whose single "block" per request
is a fixed-size state slot (conv state + temporal state). Bytes moved for a request are the
block ids it holds in each group times the bytes one block holds across the group's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence


class GroupKind(str, Enum):
    ATTENTION = "attention"
    DELTANET = "deltanet"  # any recurrent-state (Mamba-family) group


@dataclass(frozen=True, slots=True)
class CacheGroup:
    kind: GroupKind
    num_layers: int
    # Bytes one block (attention) or one state slot (DeltaNet) holds, per layer, as read
    # over NIXL: the real content, not the padding vLLM adds to unify page sizes.
    bytes_per_block_per_layer: int
    block_size: int  # tokens per block (attention); 0 for state groups


@dataclass(frozen=True, slots=True)
class TransferBytes:
    attention_kv: int
    deltanet_state: int

    @property
    def total(self) -> int:
        return self.attention_kv + self.deltanet_state


@dataclass(frozen=True, slots=True)
class StateLayout:
    groups: tuple[CacheGroup, ...]
    num_blocks: int  # blocks in the engine's pool (shared by all groups)

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> "StateLayout":
        from vllm.v1.kv_cache_interface import (
            AttentionSpec,
            MambaSpec,
            UniformTypeKVCacheSpecs,
        )

        groups = []
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = next(iter(spec.kv_cache_specs.values()))
            if isinstance(spec, MambaSpec):
                groups.append(
                    CacheGroup(GroupKind.DELTANET, len(group.layer_names), spec.state_content_size_bytes, 0)
                )
            elif isinstance(spec, AttentionSpec):
                groups.append(
                    CacheGroup(
                        GroupKind.ATTENTION,
                        len(group.layer_names),
                        spec.real_page_size_bytes,
                        spec.block_size,
                    )
                )
            else:
                raise ValueError(f"unsupported KV-cache group spec {type(spec).__name__}")
        return cls(tuple(groups), kv_cache_config.num_blocks)

    @property
    def attention_kv_bytes_per_token(self) -> int:
        return sum(
            g.num_layers * g.bytes_per_block_per_layer // g.block_size
            for g in self.groups
            if g.kind is GroupKind.ATTENTION
        )

    @property
    def deltanet_state_bytes_per_request(self) -> int:
        return sum(
            g.num_layers * g.bytes_per_block_per_layer for g in self.groups if g.kind is GroupKind.DELTANET
        )

    def bytes_for(self, block_ids: Sequence[Sequence[int]]) -> TransferBytes:
        """Bytes a transfer of these per-group block ids moves."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"expected block ids for {len(self.groups)} KV-cache groups, got {len(block_ids)}")
        per_kind = {GroupKind.ATTENTION: 0, GroupKind.DELTANET: 0}
        for group, ids in zip(self.groups, block_ids):
            per_kind[group.kind] += len(ids) * group.num_layers * group.bytes_per_block_per_layer
        return TransferBytes(per_kind[GroupKind.ATTENTION], per_kind[GroupKind.DELTANET])
