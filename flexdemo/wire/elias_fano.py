"""Elias-Fano coding of each block's kept positions: fewer bits than fixed-width indices, in a
size fixed by (blocks, k, block size) alone, so every replica's payload keeps one length and
the exchange stays one all_gather.

A block's ``k`` positions in ``[0, n)``, sorted non-decreasing, are split into ``l`` low bits
(``l = floor(log2(n / k))``, 0 when ``k >= n/2``), written as they are, and a high part
``p >> l``, written in unary: bit ``(p_i >> l) + i`` is set in a bit vector of
``k + ((n - 1) >> l) + 1`` bits. Per block that is ``k*l + k + ((n-1) >> l) + 1`` bits, about
``k * (2 + log2(n/k))``: for 64x64 blocks 9 bits a position at k = 32 (12 fixed), 8 at 64,
7 at 128, 10 at 16, 11 at 8, 12 at 4. No code of a fixed size does better than
``log2(C(n, k)) / k`` bits a position for arbitrary sets (8.32 at n = 4096, k = 32): the
positions carry that much information.

Layout of ``B`` blocks: every block's low bits (``pack_uint``, ``l`` bits each, block-major),
then every block's bit vector, one after another (``pack_uint``, 1 bit each).
"""

from __future__ import annotations

import torch

from flexdemo.wire.bitpack import pack_uint, packed_nbytes, unpack_uint


def low_bits(k: int, n: int) -> int:
    """``floor(log2(n / k))`` for ``1 <= k <= n``."""
    return max((n // k).bit_length() - 1, 0)


def high_bits(k: int, n: int) -> int:
    """Length of a block's unary bit vector."""
    return k + ((n - 1) >> low_bits(k, n)) + 1


def positions_nbytes(num_blocks: int, k: int, n: int) -> int:
    """Bytes of ``num_blocks`` blocks' coded positions."""
    return packed_nbytes(num_blocks * k, low_bits(k, n)) + packed_nbytes(num_blocks * high_bits(k, n), 1)


def pack_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, k]`` positions, each row sorted non-decreasing, in ``[0, n)`` -> uint8 bytes."""
    B, k = positions.shape
    l, h = low_bits(k, n), high_bits(k, n)
    pos = positions.to(torch.int64)
    vector = torch.zeros(B, h, dtype=torch.uint8, device=positions.device)
    vector.scatter_(1, (pos >> l) + torch.arange(k, device=positions.device), 1)
    return torch.cat([pack_uint(pos & ((1 << l) - 1), l), pack_uint(vector, 1)])


def unpack_positions(packed: torch.Tensor, num_blocks: int, k: int, n: int) -> torch.Tensor:
    """``[..., positions_nbytes]`` -> ``[..., num_blocks, k]`` int64 positions, as packed."""
    l, h = low_bits(k, n), high_bits(k, n)
    lead = packed.shape[:-1]
    low_nbytes = packed_nbytes(num_blocks * k, l)
    low = unpack_uint(packed[..., :low_nbytes], l, num_blocks * k).reshape(*lead, num_blocks, k)
    vector = unpack_uint(packed[..., low_nbytes:], 1, num_blocks * h).reshape(*lead, num_blocks, h)
    # The i-th set bit of a vector sits at high_i + i: the set bits' columns, in order, via a
    # stable sort (no data-dependent shapes, so no wait on the host on a GPU).
    columns = torch.argsort(1 - vector, dim=-1, stable=True)[..., :k]
    high = columns - torch.arange(k, device=packed.device)
    return (high << l) | low
