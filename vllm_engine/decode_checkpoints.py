"""Decoding keeps a hybrid's last recurrent-state checkpoints, not one at every block end.

With pdserve's checkpoints (`--state-checkpoint-tokens`; vLLM's prefix_cache_retention_interval
None) vLLM keeps every state written on a block end, so decoding leaves one at each block end
it passes: a block per state group each, three times the cache the answer's attention blocks
take on a Qwen3.5-style model. What reuses a decoded state is the next turn of the
conversation, which resumes at the last block end the answer passed; an earlier one only
serves a next turn whose re-tokenized answer differs before that end. So each request keeps
its last `KEPT` decode checkpoints and hands the older ones back as free blocks, first to be
reused. vLLM 0.32 has no setting for it (retention is one interval for prompts and answers
alike); its own rule (retention 0) keeps no decode checkpoint at all.
"""

from __future__ import annotations

import functools
from typing import Any

# The last block end decoded past, and the one before it for a next turn whose answer
# re-tokenizes differently in its last block.
KEPT = 2


def install() -> None:
    """Patch vLLM's Mamba cache manager in this process (idempotent)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    if getattr(MambaManager.cache_blocks, "keeps_last_decode_checkpoints", False):
        return
    cache_blocks = MambaManager.cache_blocks
    pop_blocks_for_free = MambaManager.pop_blocks_for_free

    @functools.wraps(cache_blocks)
    def cache_blocks_keeping_the_last(self: Any, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        before = self.num_cached_block.get(request.request_id, 0)
        cache_blocks(self, request, num_tokens, *args, **kwargs)
        after = self.num_cached_block.get(request.request_id, 0)
        if self.mamba_cache_mode == "align" and after > before:
            _roll(self, request, before, after)

    @functools.wraps(pop_blocks_for_free)
    def pop_blocks_forgetting_checkpoints(self: Any, request_id: str) -> Any:
        _decoded(self).pop(request_id, None)
        return pop_blocks_for_free(self, request_id)

    cache_blocks_keeping_the_last.keeps_last_decode_checkpoints = True  # type: ignore[attr-defined]
    MambaManager.cache_blocks = cache_blocks_keeping_the_last
    MambaManager.pop_blocks_for_free = pop_blocks_forgetting_checkpoints


def _decoded(manager: Any) -> dict[str, list[tuple[Any, Any]]]:
    """Per request, its decode checkpoints kept so far, oldest first: (block, its hash)."""
    if not hasattr(manager, "_pdserve_decode_checkpoints"):
        manager._pdserve_decode_checkpoints = {}
    return manager._pdserve_decode_checkpoints


def _roll(manager: Any, request: Any, before: int, after: int) -> None:
    blocks = manager.req_to_blocks[request.request_id]
    kept = _decoded(manager).setdefault(request.request_id, [])
    for index in range(before, after):
        block = blocks[index]
        # Prompt checkpoints stay: other prompts sharing the prefix resume from them.
        if block.is_null or block.block_hash is None or (index + 1) * manager.block_size <= request.num_prompt_tokens:
            continue
        kept.append((block, block.block_hash))
        while len(kept) > KEPT:
            _release(manager, request.request_id, *kept.pop(0))


def _release(manager: Any, request_id: str, block: Any, block_hash: Any) -> None:
    """Uncache an older decode checkpoint if it is still this request's own: held by it alone,
    or already freed (vLLM frees a passed state block during decode) and still unclaimed."""
    if block.block_hash != block_hash:
        return  # evicted meanwhile, perhaps reused by another request
    pool = manager.block_pool
    if block.ref_cnt == 0:
        pool.free_block_queue.remove(block)
        pool._maybe_evict_cached_block(block)
        pool.free_block_queue.prepend_n([block])
    elif block.ref_cnt == 1 and any(b is block for b in manager.req_to_blocks[request_id]):
        pool._maybe_evict_cached_block(block)  # back to the pool uncached when the request ends
