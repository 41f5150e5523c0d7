"""Fused payload (un)packing: the bit streams of :mod:`flexdemo.wire.format`, one Triton
launch per stream, the same bytes as the torch path."""

from __future__ import annotations

import torch

from flexdemo.kernels.common import HAVE_TRITON, INTERPRET
from flexdemo.wire.bitpack import bits_for, packed_nbytes
from flexdemo.wire.format import SCALE_NBYTES, count_bits, value_nbytes, voter_counts

_PACK_BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_bits_kernel(src_ptr, out_ptr, n, nbytes, BITS: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr):
        # Output byte q holds stream bits 8q..8q+7; stream bit g is bit g % BITS of value g // BITS
        # (LSB first, as flexdemo.wire.bitpack.pack_uint). SIGN packs the sign bits of fp32 values.
        q = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for t in tl.static_range(8):
            g = q * 8 + t
            v = g // BITS
            m = v < n
            if SIGN:
                x = (tl.load(src_ptr + v, mask=m, other=0.0).to(tl.int32, bitcast=True) >> 31) & 1
            else:
                x = (tl.load(src_ptr + v, mask=m, other=0).to(tl.int32) >> (g - v * BITS).to(tl.int32)) & 1
            acc = acc | (x << t)
        tl.store(out_ptr + q, acc.to(tl.uint8), mask=q < nbytes)

    @triton.jit
    def _unpack_bits_kernel(
        src_ptr, src_stride, out_ptr, count, nbytes, voters_ptr, BITS: tl.constexpr, SIGN: tl.constexpr,
        BLOCK: tl.constexpr, K: tl.constexpr, VOTERS: tl.constexpr,
    ):
        # Value v of row w is stream bits v*BITS.. of that row: at most 3 bytes for BITS <= 17.
        # VOTERS: slot v % K of block v // K casts no vote past that block's voter count
        # (voters[w, v // K]): it reads as index -1 / value 0.
        w = tl.program_id(1).to(tl.int64)
        v = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = v < count
        g = v * BITS
        byte0 = g // 8
        word = tl.zeros([BLOCK], dtype=tl.int32)
        for t in tl.static_range(3):
            part = tl.load(src_ptr + w * src_stride + byte0 + t, mask=m & (byte0 + t < nbytes), other=0)
            word = word | (part.to(tl.int32) << (8 * t))
        x = (word >> (g - byte0 * 8).to(tl.int32)) & ((1 << BITS) - 1)
        if VOTERS:
            block = v // K
            votes = (v - block * K) < tl.load(voters_ptr + w * (count // K) + block, mask=m, other=0)
        if SIGN:
            y = 1.0 - 2.0 * x.to(tl.float32)  # 1 = negative
            if VOTERS:
                y = tl.where(votes, y, 0.0)
            tl.store(out_ptr + w * count + v, y, mask=m)
        else:
            if VOTERS:
                x = tl.where(votes, x, -1)
            tl.store(out_ptr + w * count + v, x, mask=m)


    @triton.jit
    def _voters_first_kernel(idx_ptr, vals_ptr, idx_out, vals_out, rows, K: tl.constexpr, KP: tl.constexpr,
                             ROWS: tl.constexpr):
        # ROWS block rows of K slots: the non-zero values (voters) first, then the zeros, each
        # part in its slots' order (a stable partition, as codec.voters_first).
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        j = tl.arange(0, KP)[None, :]
        m = (row < rows) & (j < K)
        i = tl.load(idx_ptr + row * K + j, mask=m, other=0)
        v = tl.load(vals_ptr + row * K + j, mask=m, other=0.0)
        vote = (v != 0.0) & m
        votes = vote.to(tl.int32)
        before = tl.cumsum(votes, axis=1) - votes  # voters before this slot
        voters = tl.sum(votes, axis=1)[:, None]
        slot = tl.where(vote, before, voters + j - before)  # j - before: zeros before this slot
        tl.store(idx_out + row * K + slot, i, mask=m)
        tl.store(vals_out + row * K + slot, v, mask=m)


def fused_voters_first(idx: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flexdemo.compression.codec.voters_first` in one launch (new tensors)."""
    _check_device(idx, "fused_voters_first")
    if idx.numel() == 0:
        return idx.clone(), vals.clone()
    rows, k = idx.shape
    kp = triton.next_power_of_2(k)
    per = max(1, 1024 // kp)
    idx, vals = idx.contiguous(), vals.contiguous()
    idx_out, vals_out = torch.empty_like(idx), torch.empty_like(vals)
    _voters_first_kernel[(triton.cdiv(rows, per),)](idx, vals, idx_out, vals_out, rows, K=k, KP=kp, ROWS=per)
    return idx_out, vals_out


def _check_device(t: torch.Tensor, who: str) -> None:
    """The caller picks the path (flexdemo.compression.paths): these kernels never fall back."""
    if not (HAVE_TRITON and (t.device.type == "cuda" or (t.device.type == "cpu" and INTERPRET))):
        raise ValueError(f"{who}: needs Triton and a CUDA tensor (or a CPU one under TRITON_INTERPRET=1), "
                         f"got a {t.device.type} tensor; the torch path is flexdemo.compression.codec")


def fused_pack_payload(
    idx: torch.Tensor, vals: torch.Tensor, block_numel: int, encoding: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same bytes as :func:`flexdemo.compression.codec.pack_payload` (``idx``/``vals`` ``[B, k]``),
    with one Triton launch per bit stream (with 1-bit values, one more first to put each row's
    voters first: :func:`fused_voters_first`).

    ``out`` (uint8, the stream's length, e.g. a slice of the step's send buffer) is filled
    and returned when given, which saves the final concatenation.
    """
    _check_device(idx, "fused_pack_payload")
    bits = bits_for(block_numel)
    n = idx.numel()
    num_blocks, k = idx.shape
    idx_bytes = packed_nbytes(n, bits)
    total = idx_bytes + value_nbytes(num_blocks, k, encoding)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=idx.device)
    elif out.dtype != torch.uint8 or out.numel() != total or not out.is_contiguous():
        raise ValueError(f"fused_pack_payload: out must be {total} contiguous uint8")
    if encoding in ("sign", "scaled_sign"):  # the voter counts need each row's voters first
        idx, vals = fused_voters_first(idx, vals.reshape(num_blocks, k))
    flat_idx, flat_vals = idx.reshape(-1).contiguous(), vals.reshape(-1).contiguous()
    if bits > 0 and idx_bytes:
        _pack_bits_kernel[(triton.cdiv(idx_bytes, _PACK_BLOCK),)](
            flat_idx, out, n, idx_bytes, BITS=bits, SIGN=False, BLOCK=_PACK_BLOCK)
    val_out = out[idx_bytes:]
    if encoding == "fp32":
        val_out.copy_(flat_vals.to(torch.float32).view(torch.uint8))
    elif encoding == "bf16":
        val_out.copy_(flat_vals.to(torch.bfloat16).view(torch.uint8))
    else:
        sign_bytes = packed_nbytes(n, 1)
        if sign_bytes:
            _pack_bits_kernel[(triton.cdiv(sign_bytes, _PACK_BLOCK),)](
                flat_vals.to(torch.float32), val_out, n, sign_bytes, BITS=1, SIGN=True, BLOCK=_PACK_BLOCK)
        count_nbytes = packed_nbytes(num_blocks, count_bits(k))
        counts = voter_counts(vals.reshape(num_blocks, k)).to(torch.int32)
        if count_nbytes:
            _pack_bits_kernel[(triton.cdiv(count_nbytes, _PACK_BLOCK),)](
                counts, val_out[sign_bytes:], num_blocks, count_nbytes, BITS=count_bits(k), SIGN=False,
                BLOCK=_PACK_BLOCK)
        if encoding == "scaled_sign":  # every voter of a block has the block's magnitude; slot 0 votes if any does
            scales = vals.reshape(num_blocks, k)[:, 0].abs().to(torch.float32).contiguous()
            val_out[sign_bytes + count_nbytes:].copy_(scales.view(torch.uint8))
    return out


def fused_unpack_payload(
    payload: torch.Tensor, num_blocks: int, k: int, block_numel: int, encoding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`flexdemo.compression.codec.unpack_payload` for fp32 values, but ``idx`` is int32
    (-1 where a slot casts no vote).

    ``payload`` is ``[W, nbytes]`` with unit stride along bytes (a column slice of the
    gathered buffer is fine). Returns ``idx`` [W, B, k] int32 and ``vals`` [W, B, k] fp32.
    """
    _check_device(payload, "fused_unpack_payload")
    W, count, bits = payload.shape[0], num_blocks * k, bits_for(block_numel)
    if payload.stride(1) != 1:
        payload = payload.contiguous()
    idx_bytes = packed_nbytes(count, bits)
    idx = torch.zeros(W, num_blocks, k, dtype=torch.int32, device=payload.device)
    grid = (triton.cdiv(count, _PACK_BLOCK), W)
    raw = payload[:, idx_bytes:]
    if encoding in ("sign", "scaled_sign"):
        # The voter counts first (W x B, small): the index and sign kernels read them.
        sign_bytes = packed_nbytes(count, 1)
        count_nbytes = packed_nbytes(num_blocks, count_bits(k))
        voters = torch.zeros(W, num_blocks, dtype=torch.int32, device=payload.device)
        if count:
            # The unpack kernel takes a base pointer: pass each region via its own view.
            _unpack_bits_kernel[(triton.cdiv(num_blocks, _PACK_BLOCK), W)](
                raw[:, sign_bytes:], payload.stride(0), voters, num_blocks, count_nbytes, voters,
                BITS=count_bits(k), SIGN=False, BLOCK=_PACK_BLOCK, K=1, VOTERS=False)
            if bits > 0:
                _unpack_bits_kernel[grid](payload, payload.stride(0), idx, count, idx_bytes, voters,
                                          BITS=bits, SIGN=False, BLOCK=_PACK_BLOCK, K=k, VOTERS=True)
            else:  # one coefficient per block: its index is 0 where it votes
                idx.copy_(torch.where(torch.arange(k, device=idx.device) < voters.unsqueeze(-1), 0, -1))
        vals = torch.empty(W, num_blocks, k, dtype=torch.float32, device=payload.device)
        if count:
            _unpack_bits_kernel[grid](raw, payload.stride(0), vals, count, sign_bytes, voters,
                                      BITS=1, SIGN=True, BLOCK=_PACK_BLOCK, K=k, VOTERS=True)
        if encoding == "scaled_sign":
            start = sign_bytes + count_nbytes
            scales = raw[:, start:start + SCALE_NBYTES * num_blocks].contiguous().reshape(-1).clone()
            vals *= scales.view(torch.float32).reshape(W, num_blocks, 1)
            idx = torch.where(vals != 0, idx, -1)  # a zero scale: the block cast no vote
        return idx, vals
    if bits > 0 and count:
        _unpack_bits_kernel[grid](payload, payload.stride(0), idx, count, idx_bytes, idx,
                                  BITS=bits, SIGN=False, BLOCK=_PACK_BLOCK, K=k, VOTERS=False)
    # A fresh buffer: the values may start at any byte and view() needs alignment.
    flat = raw.reshape(-1).clone()  # clone: a W == 1 slice would keep its odd offset
    vals = flat.view(torch.float32 if encoding == "fp32" else torch.bfloat16).to(torch.float32)
    vals = vals.reshape(W, num_blocks, k)
    return torch.where(vals != 0, idx, -1), vals  # a zero value casts no vote
