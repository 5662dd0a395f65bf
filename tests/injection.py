"""Faults injected into a handoff between prefill and decode (issue 32): what a faulty copy,
device or bookkeeping would leave, made on purpose on real engines."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import ray

from kv_transfer.digests import DIGESTS_KEY
from kv_transfer.layout import GroupKind

Tamper = Literal["noise", "flip_a_byte", "zero_conv"]


def state_slots(layout: Any, handle: Any) -> list[int]:
    """The DeltaNet state slots a handle offers."""
    return [i for g, ids in zip(layout.groups, handle.block_ids) if g.kind is GroupKind.DELTANET for i in ids]


def tamper_state(actor: Any, slots: list[int], how: Tamper) -> list[int]:
    """On the engine's ranks, over `slots`: random values in every recurrent layer's conv and
    temporal state ("noise"), one flipped bit in the first recurrent layer's temporal state
    ("flip_a_byte"), or every conv state zeroed, as if it had never been sent ("zero_conv").
    Per rank, the tensors it changed."""

    def tamper(worker: Any, slots: list[int], how: str) -> int:
        import torch

        index, changed = torch.tensor(slots), 0
        for layer in worker.vllm_config.compilation_config.static_forward_context.values():
            cache = getattr(layer, "kv_cache", None)
            if not isinstance(cache, tuple):  # a recurrent layer's is (conv, temporal)
                continue
            conv, temporal = cache
            if how == "noise":
                for state in cache:
                    state[index] = torch.randn_like(state[index])
                    changed += 1
            elif how == "zero_conv":
                conv[index] = 0
                changed += 1
            elif changed == 0:
                word = temporal[slots[0]].view(torch.int16)
                first = (0,) * word.dim()
                word[first] = word[first] ^ 0x10
                changed += 1
        return changed

    return ray.get(actor.__ray_call__.remote(lambda a: a._engine._engine.collective_rpc(tamper, args=(slots, how))))


def without_digests(result: Any) -> Any:
    """The prefill result as a handoff not sampled for digests carries it."""
    params = {k: v for k, v in result.handle.connector_params.items() if k != DIGESTS_KEY}
    return dataclasses.replace(result, handle=dataclasses.replace(result.handle, connector_params=params))


def attention_blocks_shifted(result: Any, layout: Any) -> Any:
    """The prefill result with each attention group's block table shifted by one position
    (the same blocks, each read into its neighbour's place)."""
    shifted = [
        list(ids[1:]) + list(ids[:1]) if group.kind is GroupKind.ATTENTION else list(ids)
        for group, ids in zip(layout.groups, result.handle.connector_params["remote_block_ids"])
    ]
    params = {**result.handle.connector_params, "remote_block_ids": shifted}
    return dataclasses.replace(result, handle=dataclasses.replace(result.handle, connector_params=params))
