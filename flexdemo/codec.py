"""DeMo payload codec: top-k DCT coefficients per block, packed for the replica exchange.

A tensor's payload is ``[indices | values]``, byte-aligned per tensor:

* indices: ``num_blocks * k`` ints of ``bits_for(n1 * n2)`` bits each (12 for 64x64 blocks,
  6 for 64-element 1-D chunks), packed LSB first with no padding between them;
* values, by ``encoding``:
    - ``"fp32"``: 4 bytes each, exact (the DeMo reference's update, bit for bit);
    - ``"bf16"``: 2 bytes each, rounded to nearest;
    - ``"sign"``: 1 bit each (1 = negative), decoded as -1 / +1 before averaging.

So ``payload_nbytes = ceil(B*k*bits/8) + value bytes``; for 64x64 blocks, k=32 and sign
values that is 52 bytes per 4096 elements.
"""

from __future__ import annotations

import torch

from flexdemo.bitpack import bits_for, pack_uint, packed_nbytes, unpack_uint
from flexdemo.dct import BlockLayout

VALUE_ENCODINGS = ("fp32", "bf16", "sign")


def check_encoding(encoding: str) -> None:
    if encoding not in VALUE_ENCODINGS:
        raise ValueError(f"unknown value_encoding {encoding!r}; expected one of {VALUE_ENCODINGS}")


def clamp_topk(topk: int, block_numel: int) -> int:
    return min(max(int(topk), 1), block_numel)


def value_nbytes(count: int, encoding: str) -> int:
    check_encoding(encoding)
    if encoding == "fp32":
        return 4 * count
    if encoding == "bf16":
        return 2 * count
    return packed_nbytes(count, 1)


def coefficients_nbytes(count: int, block_numel: int, encoding: str) -> int:
    """Bytes of one bit stream of ``count`` kept coefficients of ``block_numel``-sized blocks."""
    if count == 0:
        return 0
    return packed_nbytes(count, bits_for(block_numel)) + value_nbytes(count, encoding)


def payload_nbytes(layout: BlockLayout, topk: int, encoding: str) -> int:
    """Bytes one rank sends for one tensor (0 for an empty local shard)."""
    count = layout.num_blocks * clamp_topk(topk, layout.block_numel)
    return coefficients_nbytes(count, layout.block_numel, encoding)


def select_topk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (row) the ``k`` coefficients of largest magnitude: ``(indices, values)``."""
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=False).indices
    return idx, torch.gather(coeffs, -1, idx)


def sent_values(vals: torch.Tensor, encoding: str) -> torch.Tensor:
    """What error feedback removes from the momentum for the values we send.

    fp32 sends values exactly and bf16 rounds them, so the rounding error stays in the
    momentum. A sign bit has no magnitude on the momentum's scale: the selected
    coefficients count as sent in full (as in the reference) and only their vote travels.
    """
    if encoding == "bf16":
        return vals.to(torch.bfloat16).to(vals.dtype)
    return vals


def pack_payload(idx: torch.Tensor, vals: torch.Tensor, block_numel: int, encoding: str) -> torch.Tensor:
    """``idx``/``vals`` of shape ``[B, k]`` -> uint8 payload of ``payload_nbytes`` bytes."""
    packed_idx = pack_uint(idx, bits_for(block_numel))
    flat = vals.reshape(-1)
    if encoding == "fp32":
        packed_vals = flat.to(torch.float32).contiguous().view(torch.uint8)
    elif encoding == "bf16":
        packed_vals = flat.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:
        packed_vals = pack_uint(torch.signbit(flat).to(torch.uint8), 1)
    return torch.cat([packed_idx, packed_vals])


def unpack_payload(
    payload: torch.Tensor, num_blocks: int, k: int, block_numel: int, encoding: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W, nbytes]`` payloads -> indices ``[W, B, k]`` (int64) and values ``[W, B, k]`` of ``dtype``."""
    W, count = payload.shape[0], num_blocks * k
    idx_bytes = packed_nbytes(count, bits_for(block_numel))
    idx = unpack_uint(payload[:, :idx_bytes], bits_for(block_numel), count)
    # A fresh flat buffer: the values may start at any byte, and view() needs alignment.
    raw = payload[:, idx_bytes:].reshape(-1).clone()
    if encoding == "fp32":
        vals = raw.view(torch.float32).to(dtype)
    elif encoding == "bf16":
        vals = raw.view(torch.bfloat16).to(dtype)
    else:
        negative = unpack_uint(raw.view(W, -1), 1, count)
        vals = (1 - 2 * negative).to(dtype)
    return idx.reshape(W, num_blocks, k), vals.reshape(W, num_blocks, k)


def mean_of_selected(idx: torch.Tensor, vals: torch.Tensor, block_numel: int) -> torch.Tensor:
    """Dense ``[B, block_numel]`` coefficients: per coefficient, the mean over the replicas
    that selected it (zero where none did).

    Replicas are added one at a time, in rank order: within one replica a block's indices
    are distinct, so each scatter_add is free of races and every rank computes the same
    bits (a single scatter over all replicas would not be deterministic on GPUs).
    """
    W, B, _ = idx.shape
    total = vals.new_zeros(B, block_numel)
    count = vals.new_zeros(B, block_numel)
    ones = torch.ones_like(vals[0])
    for w in range(W):
        total.scatter_add_(1, idx[w], vals[w])
        count.scatter_add_(1, idx[w], ones)
    return total / count.clamp_min(1)
