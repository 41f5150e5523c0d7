"""Pack unsigned integers of a fixed bit width into a dense little-endian bit stream.

Used for top-k indices (``ceil(log2(block_numel))`` bits each: 12 for 64x64 blocks) and
for sign bits (1 bit each). Pure batched tensor ops so it runs on the device that holds
the data.
"""

from __future__ import annotations

import torch


def bits_for(num_values: int) -> int:
    """Fewest bits that can hold every integer in ``[0, num_values)`` (0 when only 0 exists)."""
    if num_values < 1:
        raise ValueError(f"num_values must be >= 1, got {num_values}")
    return (num_values - 1).bit_length()


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _byte_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = (1 << torch.arange(8, device=device, dtype=torch.int32)).to(torch.uint8)
        _WEIGHTS[device] = w
    return w


def pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Flatten ``values`` (non-negative ints < 2**bits) into ``packed_nbytes(n, bits)`` uint8s."""
    flat = values.reshape(-1)
    n = flat.numel()
    nbytes = packed_nbytes(n, bits)
    if bits == 0 or n == 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=values.device)
    shifts = torch.arange(bits, device=values.device, dtype=torch.int32)
    # [n, bits] matrix of 0/1, least significant bit first, then one long bit stream.
    bit_matrix = ((flat.to(torch.int32).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = nbytes * 8 - bit_matrix.numel()
    if pad:
        bit_matrix = torch.cat([bit_matrix, bit_matrix.new_zeros(pad)])
    # Each group of 8 bits -> one byte; the sum of distinct powers of two never exceeds 255.
    return (bit_matrix.reshape(nbytes, 8) * _byte_weights(values.device)).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_uint(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint` over the last dim: ``[..., nbytes]`` -> ``[..., count]`` int64."""
    lead = packed.shape[:-1]
    if bits == 0 or count == 0:
        return torch.zeros(*lead, count, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bit_stream = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).reshape(*lead, -1)
    bit_matrix = bit_stream[..., : count * bits].reshape(*lead, count, bits).to(torch.int64)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int64)
    return (bit_matrix * weights).sum(-1)
