"""Transfer digests: a check that decode received exactly the attention blocks and state slots
the producer held, before the request runs on them.

A block's digest is the sum of its 16-bit words and the sum of their squares, over every
layer of its KV-cache group, with its byte count. Sums rather than a hash, because they add
up: a decode engine at a lower TP receives each block in parts from several producer ranks,
and the sum of the parts' digests is the digest of the whole, whatever the layout. Any one
flipped byte, a zeroed slot or another block's contents changes them, and each costs two
reductions on the device that holds the bytes. A byte count that does not add up (heads
replicated or sliced across ranks) leaves that block unchecked rather than falsely failed.

Runs inside vLLM's worker processes (kv_transfer.digest_connector); torch is imported there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

# Where a producer's digests travel in the handle's kv_transfer_params (vLLM ignores the key).
DIGESTS_KEY = "pdserve_digests"
# The consumer's outcomes, as fields of the connector statistics (one entry per event) that
# the engine's stat logger reads (kv_transfer.metrics).
CHECKED, UNCHECKED = "pdserve_digest_checked", "pdserve_digest_unchecked"
FAILED = {"attention": "pdserve_integrity_failed_attention", "state": "pdserve_integrity_failed_state"}


@dataclass(frozen=True, slots=True)
class Digest:
    words: int  # sum of the block's 16-bit words (signed)
    squares: int  # sum of their squares
    nbytes: int

    def __add__(self, other: "Digest") -> "Digest":
        return Digest(self.words + other.words, self.squares + other.squares, self.nbytes + other.nbytes)


ZERO = Digest(0, 0, 0)


def block_digests(caches: Sequence[Any], block_ids: Sequence[int], num_blocks: int) -> list[Digest]:
    """The digest of each of `block_ids` over `caches`: one KV-cache group's layer caches,
    each a tensor (attention: blocks along the dimension of size `num_blocks`, the engine's
    kernel blocks) or a tuple of tensors (a recurrent layer's conv and temporal state, slots
    first)."""
    import torch

    if not block_ids:
        return []
    totals = [ZERO] * len(block_ids)
    for cache in caches:
        for tensor in cache if isinstance(cache, (tuple, list)) else (cache,):
            dim = 0 if isinstance(cache, (tuple, list)) else _block_dim(tensor, num_blocks)
            index = torch.tensor(block_ids, device=tensor.device)
            rows = tensor.index_select(dim, index).movedim(dim, 0).contiguous().view(len(block_ids), -1)
            words = rows.view(torch.int16 if rows.shape[1] * rows.element_size() % 2 == 0 else torch.uint8).int()
            sums = words.sum(dim=1, dtype=torch.int64).tolist()
            squares = (words * words).sum(dim=1, dtype=torch.int64).tolist()
            nbytes = rows.shape[1] * rows.element_size()
            totals = [t + Digest(s, q, nbytes) for t, s, q in zip(totals, sums, squares)]
    return totals


def _block_dim(tensor: "torch.Tensor", num_blocks: int) -> int:
    """Attention backends put the blocks first ([blocks, 2, ...]) or second ([2, blocks, ...])."""
    for dim in (0, 1):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no dimension of {num_blocks} blocks in a KV cache of shape {tuple(tensor.shape)}")


def to_wire(per_rank: Sequence[Sequence[Sequence[Digest]]]) -> list[list[list[list[int]]]]:
    """Rank -> group -> position -> [words, squares, nbytes], for kv_transfer_params."""
    return [[[[d.words, d.squares, d.nbytes] for d in group] for group in rank] for rank in per_rank]


def from_wire(data: Sequence[Sequence[Sequence[Sequence[int]]]]) -> list[list[list[Digest]]]:
    return [[[Digest(*d) for d in group] for group in rank] for rank in data]
