"""DeMo payload codec: top-k DCT coefficients per block, packed for the replica exchange.

A bit stream of ``B`` blocks with ``k`` kept coefficients each is ``[indices | values]``:

* indices: ``B * k`` ints of ``bits_for(n1 * n2)`` bits each (12 for 64x64 blocks, 6 for
  64-element 1-D chunks), packed LSB first with no padding between them;
* values, by ``encoding``:
    - ``"fp32"``: 4 bytes each, exact (the DeMo reference's update, bit for bit);
    - ``"bf16"``: 2 bytes each, rounded to nearest;
    - ``"sign"``: 1 bit each (1 = negative), decoded as -1 / +1 before averaging;
    - ``"scaled_sign"``: 1 bit each, then one fp32 scale per block (the mean magnitude of the
      block's kept coefficients), decoded as -scale / +scale: the size of what is sent
      survives, for updates that are not sign-normalised (the DiLoCo outer step).

So ``nbytes = ceil(B*k*bits/8) + value bytes``; for 64x64 blocks, k=32 and sign values that
is 52 bytes per 4096 elements (56 with scaled_sign).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from flexdemo.compression.bitpack import bits_for, pack_uint, packed_nbytes, unpack_uint
from flexdemo.compression.dct import BlockLayout, blocks_dct, blocks_idct

ValueEncoding = Literal["fp32", "bf16", "sign", "scaled_sign"]
VALUE_ENCODINGS: tuple[str, ...] = get_args(ValueEncoding)
SCALE_NBYTES = 4  # one fp32 scale per block (scaled_sign)
# The payload format's version: part of the replicas' start-up agreement, so ranks that would
# read each other's bytes differently refuse to start. Bump it with any change to the bytes.
WIRE_FORMAT_VERSION = 2


def check_encoding(encoding: str) -> None:
    if encoding not in VALUE_ENCODINGS:
        raise ValueError(f"unknown value_encoding {encoding!r}; expected one of {VALUE_ENCODINGS}")


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
    if encoding == "sign":
        return packed_nbytes(count, 1)
    return packed_nbytes(count, 1) + SCALE_NBYTES * num_blocks


def coefficients_nbytes(num_blocks: int, k: int, block_numel: int, encoding: str) -> int:
    """Bytes of one bit stream of ``num_blocks`` blocks (``block_numel`` each) keeping ``k`` each."""
    if num_blocks * k == 0:
        return 0
    return packed_nbytes(num_blocks * k, bits_for(block_numel)) + value_nbytes(num_blocks, k, encoding)


def payload_nbytes(layout: BlockLayout, topk: int, encoding: str) -> int:
    """Bytes one rank sends for one tensor (0 for an empty local shard)."""
    return coefficients_nbytes(layout.num_blocks, clamp_topk(topk, layout.block_numel), layout.block_numel, encoding)


def select_topk(coeffs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (row) the ``k`` coefficients of largest magnitude: ``(indices, values)``."""
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=False).indices
    return idx, torch.gather(coeffs, -1, idx)


def scaled_signs(vals: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` kept values -> +-(their block's mean magnitude), the sign taken from the sign bit."""
    magnitude = vals.abs().mean(dim=-1, keepdim=True)
    return torch.where(torch.signbit(vals), -magnitude, magnitude)


def sent_values(vals: torch.Tensor, encoding: str) -> torch.Tensor:
    """What error feedback removes from the accumulator for the values we send.

    fp32 sends values exactly and bf16 rounds them, so the rounding error stays in the
    accumulator; scaled_sign values are already what the receivers decode. A bare sign bit has
    no magnitude on the accumulator's scale: the selected coefficients count as sent in full
    (as in the DeMo reference) and only their vote travels.
    """
    if encoding == "bf16":
        return vals.to(torch.bfloat16).to(vals.dtype)
    return vals


def compress(acc: torch.Tensor, layout: BlockLayout, k: int, encoding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``acc``'s chunked DCT per block as ``(indices, values)`` (``scaled_sign``: the
    values replaced by +-scale); what is sent leaves ``acc`` in place (error feedback)."""
    coeffs = blocks_dct(acc, layout)
    idx, vals = select_topk(coeffs, k)
    if encoding == "scaled_sign":
        vals = scaled_signs(vals)
    sent = torch.zeros_like(coeffs).scatter_(1, idx, sent_values(vals, encoding))
    acc.sub_(blocks_idct(sent, layout))
    return idx, vals


def pack_payload(idx: torch.Tensor, vals: torch.Tensor, block_numel: int, encoding: str) -> torch.Tensor:
    """``idx``/``vals`` of shape ``[B, k]`` (as :func:`compress` returns them) -> uint8 bit stream."""
    packed_idx = pack_uint(idx, bits_for(block_numel))
    flat = vals.reshape(-1)
    if encoding == "fp32":
        packed_vals = flat.to(torch.float32).contiguous().view(torch.uint8)
    elif encoding == "bf16":
        packed_vals = flat.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:
        packed_vals = pack_uint(torch.signbit(flat).to(torch.uint8), 1)
        if encoding == "scaled_sign":  # every kept value of a block has the block's magnitude
            scales = vals.reshape(idx.shape)[:, 0].abs().to(torch.float32).contiguous()
            packed_vals = torch.cat([packed_vals, scales.view(torch.uint8)])
    return torch.cat([packed_idx, packed_vals])


def unpack_payload(
    payload: torch.Tensor, num_blocks: int, k: int, block_numel: int, encoding: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W, nbytes]`` payloads -> indices ``[W, B, k]`` (int64) and values ``[W, B, k]`` of ``dtype``."""
    W, count = payload.shape[0], num_blocks * k
    idx_bytes = packed_nbytes(count, bits_for(block_numel))
    idx = unpack_uint(payload[:, :idx_bytes], bits_for(block_numel), count)
    # A fresh flat buffer: the values may start at any byte, and view() needs alignment.
    raw = payload[:, idx_bytes:].contiguous()
    if encoding == "fp32":
        vals = raw.reshape(-1).clone().view(torch.float32).to(dtype)
    elif encoding == "bf16":
        vals = raw.reshape(-1).clone().view(torch.bfloat16).to(dtype)
    else:
        sign_bytes = packed_nbytes(count, 1)
        negative = unpack_uint(raw[:, :sign_bytes], 1, count)
        vals = (1 - 2 * negative).to(dtype)
        if encoding == "scaled_sign":
            scales = raw[:, sign_bytes:].reshape(-1).clone().view(torch.float32).to(dtype)
            vals = vals.reshape(W, num_blocks, k) * scales.reshape(W, num_blocks, 1)
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


def decode_mean(idx: torch.Tensor, vals: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Replicas' ``[W, B, k]`` coefficients of one tensor -> ``IDCT(mean over selecting replicas)``."""
    return blocks_idct(mean_of_selected(idx, vals, layout.block_numel), layout)
