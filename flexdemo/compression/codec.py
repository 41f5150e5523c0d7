"""DeMo payload codec, torch ops: top-k DCT coefficients per block, packed for the replica
exchange in the format of :mod:`flexdemo.wire.format` (bytes, constants and size formulas).

Zero casts no vote. Top-k of a block with fewer than k non-zero coefficients (a parameter
with no gradient, an all-zero block) still fills k slots; a kept coefficient whose value is
zero must not count as a vote, or a 1-bit value would read it as +1 and move every weight of
a zero-gradient parameter by lr each step. So each block's kept coefficients travel voters
(non-zero values) first: with fp32/bf16 values a zero value marks a non-voter, with 1-bit
values the block's voter count does. Decoding (:func:`unpack_payload`) returns index -1 and
value 0 for non-voters, and :func:`mean_of_selected` averages each coefficient over the
replicas that *voted* for it.
"""

from __future__ import annotations

import torch

from flexdemo.wire.bitpack import bits_for, pack_uint, packed_nbytes, unpack_uint
from flexdemo.wire.dct import BlockLayout, blocks_dct, blocks_idct
from flexdemo.wire.elias_fano import pack_positions, unpack_positions
from flexdemo.wire.format import (
    COUNTED_ENCODINGS,
    BlockTopks,
    check_index_coding,
    coefficients_nbytes,
    count_bits,
    index_nbytes,
    voter_counts,
)


def select_topk(coeffs: torch.Tensor, k: int, row_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (row) the ``k`` coefficients of largest magnitude: ``(indices, values)``.
    ``row_k``: each row's own top-k (<= k); its slots beyond that hold value 0 (no vote)."""
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=row_k is not None).indices
    vals = torch.gather(coeffs, -1, idx)
    if row_k is not None:  # sorted by magnitude: the first row_k slots are the row's top-k
        vals = torch.where(torch.arange(k, device=vals.device) < row_k.unsqueeze(-1), vals, 0.0).to(vals.dtype)
    return idx, vals


def voters_first(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, k]`` slots reordered per row so that non-zero values come first (stable)."""
    order = torch.argsort((vals == 0).to(torch.int8), dim=-1, stable=True)
    return torch.gather(idx, -1, order), torch.gather(vals, -1, order)


def voters_by_position(idx: torch.Tensor, vals: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, k]`` slots reordered per row for Elias-Fano coding: voters (non-zero values) first,
    by position; then the non-voters, placed at ``block_numel - 1`` (a non-decreasing row)."""
    key = torch.where(vals != 0, idx.to(torch.int64), block_numel)
    order = torch.argsort(key, dim=-1, stable=True)
    idx, vals = torch.gather(idx, -1, order), torch.gather(vals, -1, order)
    return torch.where(vals != 0, idx, block_numel - 1), vals


def scaled_signs(vals: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` kept values -> +-(mean magnitude of the block's non-zero values), the sign
    from the sign bit; zeros stay zero (they cast no vote)."""
    voters = (vals != 0).sum(dim=-1, keepdim=True).clamp_min(1)
    magnitude = vals.abs().sum(dim=-1, keepdim=True) / voters
    return torch.where(vals == 0, 0.0, torch.where(torch.signbit(vals), -magnitude, magnitude)).to(vals.dtype)


def two_levels(vals: torch.Tensor) -> torch.Tensor:
    """``[B, k]`` kept values -> each replaced by its block's low or high level (``two_bit``): the
    block's voters split at their mean magnitude, each level the mean magnitude of its side; the
    sign kept, zeros stay zero (no vote)."""
    voters = vals != 0
    mag = vals.abs()
    mean = mag.sum(-1, keepdim=True) / voters.sum(-1, keepdim=True).clamp_min(1)
    high = voters & (mag >= mean)
    low = voters & ~high
    hi = torch.where(high, mag, 0.0).sum(-1, keepdim=True) / high.sum(-1, keepdim=True).clamp_min(1)
    lo = torch.where(low, mag, 0.0).sum(-1, keepdim=True) / low.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(voters, torch.copysign(torch.where(high, hi, lo), vals), 0.0).to(vals.dtype)


def sent_values(vals: torch.Tensor, encoding: str) -> torch.Tensor:
    """What error feedback removes from the accumulator for the values we send.

    fp32 sends values exactly and bf16 rounds them, so the rounding error stays in the
    accumulator; scaled_sign and two_bit values are already what the receivers decode. A bare sign bit has
    no magnitude on the accumulator's scale: with ``"sign"`` each selected coefficient leaves
    the accumulator *in full* (as in the DeMo reference), although only its sign was sent.
    A zero value removes nothing, whatever the encoding.
    """
    if encoding == "bf16":
        return vals.to(torch.bfloat16).to(vals.dtype)
    return vals


def compress(acc: torch.Tensor, layout: BlockLayout, k: int, encoding: str,
             row_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``acc``'s chunked DCT per block as ``(indices, values)`` (``scaled_sign``: the
    values replaced by +-scale); what is sent leaves ``acc`` in place (error feedback).
    ``row_k``: each block's own top-k where they differ (:func:`select_topk`)."""
    coeffs = blocks_dct(acc, layout)
    idx, vals = select_topk(coeffs, k, row_k)
    if encoding == "scaled_sign":
        vals = scaled_signs(vals)
    elif encoding == "two_bit":
        vals = two_levels(vals)
    sent = torch.zeros_like(coeffs).scatter_(1, idx, sent_values(vals, encoding))
    acc.sub_(blocks_idct(sent, layout))
    return idx, vals


def pack_payload(idx: torch.Tensor, vals: torch.Tensor, block_numel: int, encoding: str,
                 index_coding: str = "fixed") -> torch.Tensor:
    """``idx``/``vals`` of shape ``[B, k]`` (as :func:`compress` returns them) -> uint8 bit
    stream. With 1-bit values each row is sent voters first, as its voter count requires; a
    non-voter's index and sign bits are sent but never read. Elias-Fano indices: voters by
    position (:func:`voters_by_position`)."""
    check_index_coding(index_coding)
    if index_coding == "elias_fano":
        idx, vals = voters_by_position(idx, vals.reshape(idx.shape), block_numel)
        packed_idx = pack_positions(idx, block_numel)
    else:
        if encoding in COUNTED_ENCODINGS:
            idx, vals = voters_first(idx, vals.reshape(idx.shape))
        packed_idx = pack_uint(idx, bits_for(block_numel))
    flat = vals.reshape(-1)
    if encoding == "fp32":
        packed_vals = flat.to(torch.float32).contiguous().view(torch.uint8)
    elif encoding == "bf16":
        packed_vals = flat.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:
        k = idx.shape[-1]
        counts = voter_counts(vals.reshape(idx.shape))
        parts = [pack_uint(torch.signbit(flat).to(torch.uint8), 1), pack_uint(counts, count_bits(k))]
        if encoding == "scaled_sign":  # every voter of a block has its magnitude; slot 0 votes if any does
            scales = vals.reshape(idx.shape)[:, 0].abs().to(torch.float32).contiguous()
            parts.append(scales.view(torch.uint8))
        elif encoding == "two_bit":  # a size bit per value, then each block's (low, high) levels
            mag = vals.reshape(idx.shape).abs().to(torch.float32)
            hi = mag.max(-1).values
            lo = torch.where(mag > 0, mag, hi.unsqueeze(-1)).min(-1).values  # hi where a block has one level
            parts.insert(1, pack_uint((mag == hi.unsqueeze(-1)).reshape(-1).to(torch.uint8), 1))
            parts.append(torch.stack([lo, hi], dim=-1).contiguous().view(torch.uint8).reshape(-1))
        packed_vals = torch.cat(parts)
    return torch.cat([packed_idx, packed_vals])


def unpack_payload(
    payload: torch.Tensor, num_blocks: int, k: int, block_numel: int, encoding: str, dtype: torch.dtype,
    index_coding: str = "fixed",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[W, nbytes]`` payloads -> indices ``[W, B, k]`` (int64) and values ``[W, B, k]`` of
    ``dtype``; a slot that casts no vote reads as index -1, value 0."""
    W, count = payload.shape[0], num_blocks * k
    idx_bytes = index_nbytes(num_blocks, k, block_numel, index_coding)
    if index_coding == "elias_fano":
        idx = unpack_positions(payload[:, :idx_bytes], num_blocks, k, block_numel)
    else:
        idx = unpack_uint(payload[:, :idx_bytes], bits_for(block_numel), count).reshape(W, num_blocks, k)
    # A fresh flat buffer: the values may start at any byte, and view() needs alignment.
    raw = payload[:, idx_bytes:].contiguous()
    if encoding == "fp32":
        vals = raw.reshape(-1).clone().view(torch.float32).to(dtype)
    elif encoding == "bf16":
        vals = raw.reshape(-1).clone().view(torch.bfloat16).to(dtype)
    else:
        sign_bytes = packed_nbytes(count, 1)
        count_bytes = packed_nbytes(num_blocks, count_bits(k))
        negative = unpack_uint(raw[:, :sign_bytes], 1, count)
        vals = (1 - 2 * negative).to(dtype).reshape(W, num_blocks, k)
        at = sign_bytes
        if encoding == "two_bit":  # the size bits sit between the signs and the counts
            high = unpack_uint(raw[:, at:at + sign_bytes], 1, count).reshape(W, num_blocks, k)
            at += sign_bytes
        voters = unpack_uint(raw[:, at:at + count_bytes], count_bits(k), num_blocks)
        votes = torch.arange(k, device=payload.device) < voters.reshape(W, num_blocks, 1)
        scales = raw[:, at + count_bytes:].reshape(-1).clone().view(torch.float32).to(dtype)
        if encoding == "scaled_sign":
            vals = vals * scales.reshape(W, num_blocks, 1)
        elif encoding == "two_bit":
            levels = scales.reshape(W, num_blocks, 2)  # (low, high)
            vals = vals * torch.where(high == 1, levels[..., 1:], levels[..., :1])
        vals = torch.where(votes, vals, 0.0).to(dtype)
    vals = vals.reshape(W, num_blocks, k)
    return torch.where(vals != 0, idx, -1), vals


def pack_blocks(idx: torch.Tensor, vals: torch.Tensor, per_block: BlockTopks | None, block_numel: int,
                encoding: str, index_coding: str = "fixed") -> torch.Tensor:
    """:func:`pack_payload`, or for blocks keeping different k (``per_block``) its sub-streams: each
    row voters first, then per distinct k the rows of that k, their first k slots (a row has at
    most its own k voters, so the slots left out cast no vote)."""
    if per_block is None:
        return pack_payload(idx, vals, block_numel, encoding, index_coding)
    idx, vals = voters_first(idx, vals.reshape(idx.shape))
    return torch.cat([pack_payload(idx[rows, :k], vals[rows, :k], block_numel, encoding, index_coding)
                      for k, rows in per_block.on(idx.device)])


def unpack_blocks(payload: torch.Tensor, num_blocks: int, k: int, per_block: BlockTopks | None, block_numel: int,
                  encoding: str, dtype: torch.dtype, index_coding: str = "fixed") -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_blocks`: ``[W, B, k]`` indices and values, a row's slots beyond its
    own k as non-voters (index -1, value 0)."""
    if per_block is None:
        return unpack_payload(payload, num_blocks, k, block_numel, encoding, dtype, index_coding)
    W = payload.shape[0]
    idx = torch.full((W, num_blocks, k), -1, dtype=torch.long, device=payload.device)
    vals = torch.zeros(W, num_blocks, k, dtype=dtype, device=payload.device)
    at = 0
    for kk, rows in per_block.on(payload.device):
        n = coefficients_nbytes(len(rows), kk, block_numel, encoding, index_coding)
        part_idx, part_vals = unpack_payload(payload[:, at:at + n], len(rows), kk, block_numel, encoding, dtype,
                                             index_coding)
        idx[:, rows, :kk] = part_idx
        vals[:, rows, :kk] = part_vals
        at += n
    return idx, vals


def vote_totals(idx: torch.Tensor, vals: torch.Tensor, block_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[B, block_numel]`` sums of the replicas' values per coefficient, and how many
    replicas voted for it. Non-voting slots (index -1, value 0) add nothing.

    Replicas are added one at a time, in rank order: within one replica a block's indices
    are distinct, so each scatter_add is free of races and every rank computes the same
    bits (a single scatter over all replicas would not be deterministic on GPUs).
    """
    W, B, _ = idx.shape
    total = vals.new_zeros(B, block_numel)
    count = vals.new_zeros(B, block_numel)
    for w in range(W):
        votes = idx[w] >= 0
        where = idx[w].long().clamp_min(0)  # a non-voter adds 0 to column 0
        total.scatter_add_(1, where, torch.where(votes, vals[w], 0.0))
        count.scatter_add_(1, where, votes.to(vals.dtype))
    return total, count


def mean_of_selected(idx: torch.Tensor, vals: torch.Tensor, block_numel: int) -> torch.Tensor:
    """Dense ``[B, block_numel]`` coefficients: per coefficient, the mean over the replicas
    that voted for it (zero where none did)."""
    total, count = vote_totals(idx, vals, block_numel)
    return total / count.clamp_min(1)


def decode_mean(idx: torch.Tensor, vals: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Replicas' ``[W, B, k]`` coefficients of one tensor -> ``IDCT(mean over voting replicas)``."""
    return blocks_idct(mean_of_selected(idx, vals, layout.block_numel), layout)
