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
WIRE_FORMAT_VERSION = 4
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


def payload_nbytes(layout: BlockLayout, topk: int, encoding: str, index_coding: str = "fixed") -> int:
    """Bytes one rank sends for one tensor (0 for an empty local shard)."""
    return coefficients_nbytes(layout.num_blocks, clamp_topk(topk, layout.block_numel), layout.block_numel, encoding,
                               index_coding)
