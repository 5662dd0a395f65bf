"""Transfer digests: a check that decode received exactly the attention blocks and state slots
the producer held, before the request runs on them.

A block's digest is the sum of its bytes read as 64-bit words and as 16-bit words (each
wrapping, as unsigned integers do), over every layer of its KV-cache group, with its byte
count. Sums rather than a hash, because they add up: a decode engine at a lower TP receives
each block in parts from several producer ranks, and the parts' digests sum to the whole's,
whatever the layout, as long as each part is whole 64-bit words (heads and state channels
are). Any one flipped bit, a zeroed slot or another block's contents changes them. Each is a
pass over the block where it lies, in the cache's own integer width: about 0.1 ms per MB on
a CPU core, a pass at memory bandwidth on a GPU. A part that is not whole 64-bit words, or
parts whose byte counts do not make the whole (heads replicated or sliced across ranks),
leave the block unchecked rather than falsely failed.

Runs inside vLLM's worker processes (kv_transfer.digest_connector); torch is imported there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

# Where a producer's digests travel in the handle's kv_transfer_params (vLLM ignores the key).
DIGESTS_KEY = "pdserve_digests"
# The consumer's outcomes, as fields of the connector statistics that the engine's stat logger
# reads (kv_transfer.metrics): each rank of a decode engine lists the request ids it checked.
CHECKED, UNCHECKED = "pdserve_digest_checked", "pdserve_digest_unchecked"
FAILED = {"attention": "pdserve_integrity_failed_attention", "state": "pdserve_integrity_failed_state"}


@dataclass(frozen=True, slots=True)
class Digest:
    words64: int  # sum of the block's bytes as 64-bit words, mod 2**64
    words16: int  # ... as 16-bit words, mod 2**16
    nbytes: int
    aligned: bool = True  # every part is whole 64-bit words (else the sums need not add up)

    def __add__(self, other: "Digest") -> "Digest":
        return Digest(
            (self.words64 + other.words64) % 2**64,
            (self.words16 + other.words16) % 2**16,
            self.nbytes + other.nbytes,
            self.aligned and other.aligned,
        )

    def matches(self, other: "Digest") -> bool:
        return (self.words64, self.words16, self.nbytes) == (other.words64, other.words16, other.nbytes)


ZERO = Digest(0, 0, 0)


def block_digests(caches: Sequence[Any], block_ids: Sequence[int], num_blocks: int) -> list[Digest]:
    """The digest of each of `block_ids` over `caches`: one KV-cache group's layer caches,
    each a tensor (attention: blocks along the dimension of size `num_blocks`, the engine's
    kernel blocks) or a tuple of tensors (a recurrent layer's conv and temporal state, slots
    first). Sums over views of the cache: nothing is copied."""
    import torch

    if not block_ids:
        return []
    totals = [ZERO] * len(block_ids)
    for cache in caches:
        for tensor in cache if isinstance(cache, (tuple, list)) else (cache,):
            dim = 0 if isinstance(cache, (tuple, list)) else _block_dim(tensor, num_blocks)
            nbytes = tensor.nbytes // tensor.shape[dim]
            blocks = [tensor.select(dim, block) for block in block_ids]
            aligned = nbytes % 8 == 0 and all(_whole_words(b, 8) for b in blocks)
            width = torch.int64 if aligned else torch.int16
            wide = torch.stack([b.view(width).sum(dtype=width) for b in blocks]).tolist()
            narrow = torch.stack([_sum16(b) for b in blocks]).tolist()
            totals = [
                t + Digest(w % 2**64 if aligned else 0, n % 2**16, nbytes, aligned)
                for t, w, n in zip(totals, wide, narrow)
            ]
    return totals


def _sum16(view: "torch.Tensor") -> "torch.Tensor":
    import torch

    if _whole_words(view, 2):
        return view.view(torch.int16).sum(dtype=torch.int16)
    return view.view(torch.uint8).sum(dtype=torch.int64) % 2**16  # odd-sized fp8 rows: bytes


def _whole_words(view: "torch.Tensor", size: int) -> bool:
    """Whether `view` can be read as `size`-byte words in place (its rows are whole words)."""
    return (
        view.stride(-1) == 1
        and (view.shape[-1] * view.element_size()) % size == 0
        and all((stride * view.element_size()) % size == 0 for stride in view.stride()[:-1])
    )


def _block_dim(tensor: "torch.Tensor", num_blocks: int) -> int:
    """Attention backends put the blocks first ([blocks, 2, ...]) or second ([2, blocks, ...])."""
    for dim in (0, 1):
        if tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(f"no dimension of {num_blocks} blocks in a KV cache of shape {tuple(tensor.shape)}")


def to_wire(per_rank: Sequence[Sequence[Sequence[Digest]]]) -> list[list[list[list[int]]]]:
    """Rank -> group -> position -> [words64, words16, nbytes, aligned], for kv_transfer_params."""
    return [[[[d.words64, d.words16, d.nbytes, d.aligned] for d in group] for group in rank] for rank in per_rank]


def from_wire(data: Sequence[Sequence[Sequence[Sequence[int]]]]) -> list[list[list[Digest]]]:
    return [[[Digest(*d) for d in group] for group in rank] for rank in data]
