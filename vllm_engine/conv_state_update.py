"""The decode step's conv-state update on CPU, without vLLM's per-layer staging copies.

NixlConnector needs the Gated-DeltaNet conv state stored dim-first ("DS", HYBRID_TRANSFER_ENV).
On CPUs with AVX512-BF16 (or Arm bf16), vLLM 0.32's GDN decode runs its packed-weight conv
kernel, which reads the state state-first; for DS it therefore gathers each layer's states
into a scratch copy before the kernel and scatters them back after, every step
(`gdn_attention._stage_ds_conv_states` / `_scatter_ds_conv_states`): two copies of every
layer's states per decode step, a cost stock vLLM (state-first, no transfer) does not pay
(`python -m bench.decode_step` measures it; docs/benchmarks.md).

vLLM has a kernel that reads DS in place: `causal_conv1d_update_cpu_vec`, which its own GDN
path runs on CPUs without AVX512-BF16 (`gdn_attention.causal_conv1d_update_cpu`). It needs
the unpacked weight, which vLLM keeps beside the packed one (`_cpu_unpacked_conv_weight`).
This module sends DS decode updates there. tests/test_conv_state_update.py checks that the
new state is bit-identical to the staged path's and the output within bf16 rounding, and that
an engine decodes the same tokens with either. Prefill (`causal_conv1d_fwd_cpu`) keeps vLLM's
staging: it runs once per prompt chunk, not per token.

Installed by pdserve's vLLM plugin (vllm_engine.vllm_plugin) in processes that set
DIM_FIRST_CONV_UPDATE_ENV, so every TP rank gets it; vLLM's own path is used for anything
else (speculative decoding, no unpacked weight, state-first layout).
"""

from __future__ import annotations

import functools
from typing import Any


def install() -> None:
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn

    staged = gdn._causal_conv1d_update_cpu
    if getattr(staged, "reads_dim_first_in_place", False):
        return
    unpacked_weights: dict[int, Any] = {}

    @functools.wraps(staged)
    def update_in_place(**call: Any) -> Any:  # vLLM calls it with keywords only
        unpacked = _unpacked_weight(unpacked_weights, call["weight"]) if call["is_weight_packed"] else None
        if unpacked is None or call.get("num_accepted_tokens") is not None or not gdn.is_conv_state_dim_first():
            return staged(**call)
        return gdn.causal_conv1d_update_cpu(
            x=call["x"],
            conv_state=call["conv_states"],
            weight=unpacked,
            bias=call["bias"],
            activation=call["silu_activation"],
            conv_state_indices=call["conv_state_indices"],
        )

    update_in_place.reads_dim_first_in_place = True  # type: ignore[attr-defined]
    gdn._causal_conv1d_update_cpu = update_in_place


def _unpacked_weight(cache: dict[int, Any], packed: Any) -> Any:
    """The (dim, width) weight vLLM stashed when it packed `packed` (None if it did not).
    Found once per layer among the forward context's layers, then kept by the packed
    parameter's identity (parameters live as long as the engine)."""
    key = id(packed)
    if key not in cache:
        from vllm.forward_context import get_forward_context

        for layer in get_forward_context().no_compile_layers.values():
            conv = getattr(layer, "conv1d", None)
            if conv is not None and getattr(conv, "weight", None) is packed:
                cache[key] = getattr(conv, "_cpu_unpacked_conv_weight", None)
                break
        else:
            cache[key] = None
    return cache[key]
