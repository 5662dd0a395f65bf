"""Transfer digests (kv_transfer.digests) on plain tensors: what decode's check relies on."""

import pytest
import torch

from kv_transfer.digests import Digest, block_digests, from_wire, to_wire

BLOCKS = 6


def _attention(heads: int = 4) -> torch.Tensor:
    """[2 (K, V), blocks, heads, block size, head dim], as vLLM's CPU backend lays it out."""
    return torch.randn(2, BLOCKS, heads, 8, 16, dtype=torch.bfloat16)


def _state() -> tuple[torch.Tensor, torch.Tensor]:
    """A recurrent layer's (conv, temporal) state: slots first."""
    return torch.randn(BLOCKS, 3, 24, dtype=torch.bfloat16), torch.randn(BLOCKS, 4, 16, 16, dtype=torch.float32)


def test_the_parts_of_a_block_add_up_to_the_whole_whatever_the_split():
    """A TP 2 producer's ranks each hold half the heads: their digests sum to the whole
    block's, which is what a TP 1 decode engine checks."""
    whole = _attention(heads=4)
    halves = [whole[:, :, :2].contiguous(), whole[:, :, 2:].contiguous()]
    ids = [4, 1, 3]
    parts = [block_digests([half], ids, BLOCKS) for half in halves]
    assert [a + b for a, b in zip(*parts)] == block_digests([whole], ids, BLOCKS)


def test_one_flipped_bit_a_zeroed_state_or_another_block_changes_the_digest():
    attention, (conv, temporal) = _attention(), _state()
    caches = [attention, (conv, temporal)]
    before = block_digests(caches, [2, 5], BLOCKS)
    assert before[0] != before[1]  # another block's contents: a shifted block table
    temporal[2].view(torch.int16)[0, 0, 0] ^= 0x10
    assert block_digests(caches, [2], BLOCKS)[0] != before[0]
    conv[5] = 0
    assert block_digests(caches, [5], BLOCKS)[0] != before[1]
    assert block_digests(caches, [2], BLOCKS)[0].nbytes == before[0].nbytes


def test_blocks_first_or_second_and_a_cache_without_the_block_count_is_refused():
    attention = _attention()
    blocks_first = attention.transpose(0, 1).contiguous()
    assert block_digests([blocks_first], [3], BLOCKS) == block_digests([attention], [3], BLOCKS)
    with pytest.raises(ValueError, match="no dimension of 7 blocks"):
        block_digests([attention], [3], 7)


def test_digests_cross_the_wire_intact():
    per_rank = [[[Digest(1, 2, 3), Digest(-4, 5, 6)], []], [[Digest(7, 8, 9)], [Digest(0, 0, 10)]]]
    assert from_wire(to_wire(per_rank)) == per_rank


def test_a_part_that_is_not_whole_64_bit_words_is_marked_so_decode_leaves_it_unchecked():
    conv = torch.randn(BLOCKS, 5, 3, dtype=torch.bfloat16)  # 30 bytes a slot
    (digest,) = block_digests([(conv,)], [1], BLOCKS)
    assert not digest.aligned and digest.nbytes == 30
    assert not (digest + block_digests([_state()], [1], BLOCKS)[0]).aligned


def _one_block_at_a_time(caches, block_ids, num_blocks):
    """The definition, block by block, on a contiguous copy of each block's bytes: the known
    answer for `block_digests`, which sums over views of the cache in place."""
    totals = [Digest(0, 0, 0)] * len(block_ids)
    for cache in caches:
        for tensor in cache if isinstance(cache, tuple) else (cache,):
            dim = 0 if isinstance(cache, tuple) else [d for d in (0, 1) if tensor.shape[d] == num_blocks][0]
            for i, block in enumerate(block_ids):
                view = tensor.select(dim, block)
                raw = view.contiguous().view(torch.uint8).flatten()
                aligned = raw.numel() % 8 == 0 and (view.shape[-1] * view.element_size()) % 8 == 0
                words64 = int(raw.view(torch.int64).sum()) % 2**64 if aligned else 0
                words16 = int(raw.view(torch.int16).to(torch.int64).sum()) % 2**16
                totals[i] = totals[i] + Digest(words64, words16, raw.numel(), aligned)
    return totals


@pytest.mark.parametrize("ids", [[0], [5, 2, 3], list(range(BLOCKS))])
def test_sums_over_views_equal_the_definition_on_copies(ids):
    blocks_second = _attention()
    blocks_first = _attention().transpose(0, 1).contiguous()
    fp8_like = torch.randint(0, 255, (BLOCKS, 4, 8), dtype=torch.uint8)
    unaligned = torch.randn(BLOCKS, 5, 3, dtype=torch.bfloat16)
    caches = [blocks_second, blocks_first, _state(), (fp8_like,), (unaligned,)]
    assert block_digests(caches, ids, BLOCKS) == _one_block_at_a_time(caches, ids, BLOCKS)
