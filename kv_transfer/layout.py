"""What one request's transferable state weighs, derived from the engine's KV-cache layout.

vLLM splits a hybrid model's cache into KV-cache groups: attention groups whose blocks hold
`block_size` tokens each, and Mamba/Gated-DeltaNet groups whose single "block" per request
is a fixed-size state slot (conv state + temporal state). Bytes moved for a request are the
block ids it holds in each group times the bytes one block holds across the group's layers,
times the tensor-parallel ranks: each rank holds its share of the heads in its own pool
under the same block ids (vLLM's scheduler sees one rank's page sizes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Sequence

from messages.reports import EngineCapacity
from messages.transfer import TransferBytes

# Set (to "1") in an engine's environment: decode updates read DS conv state in place
# (vllm_engine.conv_state_update).
DIM_FIRST_CONV_UPDATE_ENV = "PDSERVE_DIM_FIRST_CONV_UPDATE"
# Required by NixlConnector for Mamba/Gated-DeltaNet state: conv state stored (dim, state)
# so its sub-projections are contiguous and can be read with a few descriptors.
HYBRID_TRANSFER_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS", DIM_FIRST_CONV_UPDATE_ENV: "1"}


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
    # Blocks a max-length request holds at most where vLLM frees blocks behind it (a sliding
    # window: its `max_admission_blocks_per_request`); 0 where they grow with the request.
    window_blocks: int = 0


@dataclass(frozen=True, slots=True)
class StateLayout:
    groups: tuple[CacheGroup, ...]  # one rank's share
    num_blocks: int  # blocks in each rank's pool (shared by all groups)
    # Ranks holding a share each. When TP exceeds the KV heads, ranks hold replicas and
    # this counts every rank's copy.
    tensor_parallel_size: int = 1

    @classmethod
    def from_kv_cache_config(
        cls, kv_cache_config: Any, tensor_parallel_size: int = 1, vllm_config: Any = None
    ) -> "StateLayout":
        """`vllm_config`: the engine's, for what a sliding window holds (else counted in full)."""
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
                groups.append(CacheGroup(GroupKind.DELTANET, len(group.layer_names), spec.state_content_size_bytes, 0))
            elif isinstance(spec, AttentionSpec):
                window_blocks = 0
                if vllm_config is not None and hasattr(spec, "max_admission_blocks_per_request"):
                    window_blocks = spec.max_admission_blocks_per_request(
                        vllm_config.max_in_flight_tokens, vllm_config.model_config.max_model_len
                    )
                groups.append(
                    CacheGroup(
                        GroupKind.ATTENTION,
                        len(group.layer_names),
                        spec.real_page_size_bytes,
                        spec.block_size,
                        window_blocks,
                    )
                )
            else:
                raise ValueError(f"unsupported KV-cache group spec {type(spec).__name__}")
        return cls(tuple(groups), kv_cache_config.num_blocks, tensor_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StateLayout":
        groups = tuple(
            CacheGroup(
                GroupKind(g["kind"]),
                g["num_layers"],
                g["bytes_per_block_per_layer"],
                g["block_size"],
                g.get("window_blocks", 0),
            )
            for g in data["groups"]
        )
        return cls(groups, data["num_blocks"], data.get("tensor_parallel_size", 1))

    @property
    def attention_kv_bytes_per_token(self) -> int:
        """All ranks together."""
        per_rank = sum(
            g.num_layers * g.bytes_per_block_per_layer // g.block_size
            for g in self.groups
            if g.kind is GroupKind.ATTENTION
        )
        return per_rank * self.tensor_parallel_size

    @property
    def deltanet_state_bytes_per_request(self) -> int:
        """All ranks together."""
        per_rank = sum(g.num_layers * g.bytes_per_block_per_layer for g in self.groups if g.kind is GroupKind.DELTANET)
        return per_rank * self.tensor_parallel_size

    @property
    def block_size(self) -> int:
        """Attention tokens per block (vLLM gives every attention group the same)."""
        return next(g.block_size for g in self.groups if g.kind is GroupKind.ATTENTION)

    def capacity(self, max_model_len: int, max_num_seqs: int, prefix_caching: bool) -> "EngineCapacity":
        """What this engine's pool holds (vLLM keeps one null block back)."""
        usable = max(0, self.num_blocks - 1)
        per_request = sum(
            1 if g.kind is GroupKind.DELTANET else g.window_blocks or -(-max_model_len // g.block_size)
            for g in self.groups
        )
        state_groups = sum(g.kind is GroupKind.DELTANET for g in self.groups)
        return EngineCapacity(
            kv_blocks=usable,
            deltanet_state_slots=usable if state_groups else 0,
            blocks_per_max_length_request=per_request,
            max_concurrent_max_length_requests=min(max_num_seqs, usable // per_request),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
            block_size=self.block_size,
            prefix_caching=prefix_caching,
        )

    def bytes_for(self, block_ids: Sequence[Sequence[int]]) -> TransferBytes:
        """Bytes a transfer of these per-group block ids moves."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"expected block ids for {len(self.groups)} KV-cache groups, got {len(block_ids)}")
        per_kind = {GroupKind.ATTENTION: 0, GroupKind.DELTANET: 0}
        for group, ids in zip(self.groups, block_ids):
            per_kind[group.kind] += (
                len(ids) * group.num_layers * group.bytes_per_block_per_layer * self.tensor_parallel_size
            )
        return TransferBytes(per_kind[GroupKind.ATTENTION], per_kind[GroupKind.DELTANET])
