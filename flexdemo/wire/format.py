"""The payload format: top-k DCT coefficients per block, as bytes on the replica exchange.

A bit stream of ``B`` blocks with ``k`` kept coefficients each is ``[indices | values]``:

* indices, by ``index_coding``:
    - ``"fixed"``: ``B * k`` ints of ``bits_for(n1 * n2)`` bits each (12 for 64x64 blocks, 6 for
      64-element 1-D chunks), packed LSB first with no padding between them;
    - ``"elias_fano"``: each block's positions sorted, Elias-Fano coded
      (:mod:`flexdemo.wire.elias_fano`: 9 bits a position at k = 32 of 4096), the same values
      in that order; a block's non-voters come last, at position ``n - 1``;
* values, by ``encoding``:
    - ``"fp32"``: 4 bytes each, exact (the DeMo reference's update, bit for bit);
    - ``"bf16"``: 2 bytes each, rounded to nearest;
    - ``"sign"``: 1 bit each (1 = negative), decoded as -1 / +1 before averaging; then one
      *voter count* per block (``bits_for(k + 1)`` bits: 6 for k = 32);
    - ``"scaled_sign"``: 1 bit each, then the voter counts, then one fp32 scale per block
      (the mean magnitude of the block's non-zero kept coefficients), decoded as -scale /
      +scale: the size of what is sent survives, for updates that are not sign-normalised
      (the DiLoCo outer step);
    - ``"two_bit"``: a sign bit each, then a size bit each (1 = the block's high level), the
      voter counts, then two fp32 levels per block (low, high): a block's voters split at their
      mean magnitude, each level the mean magnitude of its side (2 bits a value, as SparseLoCo).

Zero casts no vote: each block's kept coefficients travel voters (non-zero values) first; with
fp32/bf16 values a zero value marks a non-voter, with 1-bit values the block's voter count does.

The sharded exchange's second stream, an owner's means, is this format too, in
:func:`means_encoding` (bf16 where the replicas send 1-bit values).

How many coefficients a block keeps (:func:`block_topk`): the configured top-k is a count per
full block, ``chunk x chunk`` of a 2-D tensor (a tensor of more dims is viewed as ``lead x rows x
cols``), ``chunk`` elements of a 1-D one (norm weights, biases: a full 64-element chunk keeps
top-k, clamped to its 64 coefficients, as the DeMo reference keeps it on ``1 x n`` blocks); a
smaller block (a 2-D tensor with fewer rows than ``chunk``, the partial edge blocks of an FSDP
shard, a 1-D shard's partial last chunk) keeps top-k scaled to its share of that full area
(its elements inside the tensor / the full area), rounded half up, at least 1, at most its
coefficients. So bytes per parameter do not depend on how FSDP splits a tensor. A run of blocks
whose k differ (a shard ending in a partial row of blocks) travels as one sub-stream per k,
largest k first (:class:`BlockTopks`), each in the layout below.

So ``nbytes = ceil(B*k*bits/8) + value bytes``; for 64x64 blocks, k=32 and sign values that
is 52.75 bytes per 4096 elements (56.75 with scaled_sign). The writers and readers of these
bytes are :mod:`flexdemo.compression.codec` (torch ops) and :mod:`flexdemo.kernels.pack`
(Triton); both give the same bytes.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from flexdemo.wire.bitpack import bits_for, packed_nbytes
from flexdemo.wire.dct import BlockLayout
from flexdemo.wire.elias_fano import positions_nbytes

ValueEncoding = Literal["fp32", "bf16", "sign", "scaled_sign", "two_bit"]
VALUE_ENCODINGS: tuple[str, ...] = get_args(ValueEncoding)
IndexCoding = Literal["fixed", "elias_fano"]
INDEX_CODINGS: tuple[str, ...] = get_args(IndexCoding)
SCALE_NBYTES = 4  # one fp32 scale per block (scaled_sign; two of them: two_bit)
COUNTED_ENCODINGS = ("sign", "scaled_sign", "two_bit")  # values sent voters first, with a voter count per block
# The payload format's version: part of the replicas' start-up agreement, so ranks that would
# read each other's bytes differently refuse to start. Bump it with any change to the bytes.
# 5: top-k scaled to each block's share of chunk x chunk. 6: a 1-D tensor's full area is chunk
# (its chunks keep top-k x valid / chunk, as the DeMo reference); 2-D and more as in 5.
WIRE_FORMAT_VERSION = 6
# Each replica's payload ends with one flag byte: 1 = it saw a non-finite value (every replica
# then skips, or stops, alike).
FLAG_BYTES = 1


def means_encoding(encoding: str) -> str:
    """How the sharded exchange's owners send their means, given the replicas' value encoding:
    fp32 and bf16 as they are; a 1-bit encoding's mean (a fraction of agreeing votes) as bf16,
    since its sign alone drops how strongly the replicas agreed (+4.5% held-out loss at W = 4)."""
    check_encoding(encoding)
    return encoding if encoding in ("fp32", "bf16") else "bf16"


def check_encoding(encoding: str) -> None:
    if encoding not in VALUE_ENCODINGS:
        raise ValueError(f"unknown value_encoding {encoding!r}; expected one of {VALUE_ENCODINGS}")


def check_index_coding(coding: str) -> None:
    if coding not in INDEX_CODINGS:
        raise ValueError(f"unknown index_coding {coding!r}; expected one of {INDEX_CODINGS}")


def index_nbytes(num_blocks: int, k: int, block_numel: int, coding: str = "fixed") -> int:
    """Bytes of the index part for ``num_blocks`` blocks of ``k`` kept positions each."""
    check_index_coding(coding)
    if coding == "elias_fano":
        return positions_nbytes(num_blocks, k, block_numel)
    return packed_nbytes(num_blocks * k, bits_for(block_numel))


def clamp_topk(topk: int, block_numel: int) -> int:
    return min(max(int(topk), 1), block_numel)


def full_block_area(layout: BlockLayout) -> int:
    """The elements of a full block, which the configured top-k is a count for: ``chunk`` for a
    1-D (or 0-D) tensor, whose blocks are ``1 x chunk`` chunks; ``chunk**2`` for a tensor of 2 or
    more dims (viewed as ``lead x rows x cols``), also where it has fewer rows than ``chunk``."""
    return layout.chunk if len(layout.shape) <= 1 else layout.chunk * layout.chunk


def block_topk(topk: int, area: int, block_numel: int, *, full_area: int) -> int:
    """Coefficients kept of one block with ``area`` elements inside the tensor: ``topk`` (a count
    per full block of ``full_area`` elements, :func:`full_block_area`) times ``area / full_area``,
    rounded half up, at least 1 and at most the block's ``block_numel`` coefficients."""
    return clamp_topk((2 * int(topk) * area + full_area) // (2 * full_area), block_numel)


def block_topks(layout: BlockLayout, topk: int) -> tuple[int, tuple[int, ...] | None]:
    """``(k, per_block)``: the top-k of ``layout``'s largest blocks, and each block's own top-k
    in block order when they differ (partial edge blocks), else None."""
    full = full_block_area(layout)
    if not layout.padded or not layout.numel:  # every block full-sized: one k (no per-block list)
        return block_topk(topk, layout.block_numel, layout.block_numel, full_area=full), None
    areas = layout.block_areas()
    ks = tuple(block_topk(topk, a, layout.block_numel, full_area=full) for a in areas)
    k = max(ks)
    return k, (ks if min(ks) != k else None)


class BlockTopks:
    """A run of blocks whose top-k differ, as the wire carries it: one sub-stream per distinct k
    (largest first), each the blocks of that k in order, ``k`` slots each (voters first)."""

    def __init__(self, per_block: tuple[int, ...]):
        self.per_block = tuple(per_block)
        self.k = max(self.per_block)
        rows: dict[int, list[int]] = {}
        for b, k in enumerate(self.per_block):
            rows.setdefault(k, []).append(b)
        self.streams = sorted(rows.items(), key=lambda kv: -kv[0])  # [(k, block rows)]
        self._on: dict = {}  # per device: the sub-streams' rows, and the per-block k

    def __len__(self) -> int:
        return len(self.per_block)

    def slice(self, start: int, stop: int) -> "BlockTopks | None":
        part = self.per_block[start:stop]
        return BlockTopks(part) if part else None

    def on(self, device: torch.device) -> list[tuple[int, torch.Tensor]]:
        """The sub-streams' ``(k, row indices)`` on ``device`` (made once per device)."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = [(k, torch.tensor(r, dtype=torch.long, device=device)) for k, r in self.streams]
        return self._on[device]

    def per_block_on(self, device: torch.device) -> torch.Tensor:
        """Each block's k as a device tensor (made once per device)."""
        device = torch.device(device)
        if ("k", device) not in self._on:
            self._on[("k", device)] = torch.tensor(self.per_block, dtype=torch.long, device=device)
        return self._on[("k", device)]

    def nbytes(self, block_numel: int, encoding: str, index_coding: str = "fixed") -> int:
        return sum(coefficients_nbytes(len(r), k, block_numel, encoding, index_coding) for k, r in self.streams)


def value_nbytes(num_blocks: int, k: int, encoding: str) -> int:
    """Bytes of the value part for ``num_blocks`` blocks of ``k`` kept coefficients."""
    check_encoding(encoding)
    count = num_blocks * k
    if encoding == "fp32":
        return 4 * count
    if encoding == "bf16":
        return 2 * count
    votes = packed_nbytes(count, 1) + packed_nbytes(num_blocks, count_bits(k))
    if encoding == "sign":
        return votes
    if encoding == "two_bit":
        return votes + packed_nbytes(count, 1) + 2 * SCALE_NBYTES * num_blocks
    return votes + SCALE_NBYTES * num_blocks


def count_bits(k: int) -> int:
    """Bits of a block's voter count (0..k) in the 1-bit encodings."""
    return bits_for(k + 1)


def voter_counts(vals: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` values -> each block's number of voters (non-zero values): the count field."""
    return (vals != 0).sum(dim=-1)


def coefficients_nbytes(num_blocks: int, k: int, block_numel: int, encoding: str, index_coding: str = "fixed") -> int:
    """Bytes of one bit stream of ``num_blocks`` blocks (``block_numel`` each) keeping ``k`` each."""
    if num_blocks * k == 0:
        return 0
    return index_nbytes(num_blocks, k, block_numel, index_coding) + value_nbytes(num_blocks, k, encoding)


def blocks_nbytes(num_blocks: int, k: int, per_block: BlockTopks | None, block_numel: int, encoding: str,
                  index_coding: str = "fixed") -> int:
    """Bytes of ``num_blocks`` blocks keeping ``k`` each, or each its own (``per_block``)."""
    if per_block is not None:
        return per_block.nbytes(block_numel, encoding, index_coding)
    return coefficients_nbytes(num_blocks, k, block_numel, encoding, index_coding)


def payload_nbytes(layout: BlockLayout, topk: int, encoding: str, index_coding: str = "fixed") -> int:
    """Bytes one rank sends for one tensor (0 for an empty local shard), ``topk`` per full
    block (``chunk x chunk``; ``chunk`` elements of a 1-D tensor: :func:`block_topks`)."""
    k, per_block = block_topks(layout, topk)
    return blocks_nbytes(layout.num_blocks, k, BlockTopks(per_block) if per_block else None, layout.block_numel,
                         encoding, index_coding)
