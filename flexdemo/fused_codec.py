"""Fused Triton kernels for DeMo's codec on 2-D tensors (one launch per tensor and phase).

The torch path (``flexdemo.optim.compress_momentum`` / ``decode_direction``) makes many
passes over the momentum: DCT matmuls, block transposes, abs, topk, a scatter into zeros,
the IDCT, the subtraction. Here each program owns one ``n1 x n2`` block of the row-major
``[R, C]`` tensor and does everything for it in registers:

* :func:`fused_encode`: ``delta = decay * delta + lr * grad``; ``Y = F1 @ X @ F2^T``; exact
  top-k of ``|Y|`` (ties broken by the lowest index); error feedback
  ``delta -= F1^T @ S @ F2`` with ``S`` the sent coefficients; writes ``delta`` back in
  place and the block's ``k`` indices (ascending) and exact values.
* :func:`fused_decode_update`: ``param -= lr * sign(F1^T @ M @ F2)`` from the dense mean
  coefficients ``M`` of :func:`flexdemo.codec.mean_of_selected` (no decoded tensor is written).
* :func:`fused_mean_decode_update`: the same, but builds ``M`` itself from the replicas'
  ``idx``/``vals`` in rank order, bitwise like ``mean_of_selected`` (no dense ``M`` at all).
* :func:`fused_pack_payload` / :func:`fused_unpack_payload`: the payload bit (un)packing of
  :mod:`flexdemo.codec` as one Triton launch per bit stream, same bytes.
* Grouped variants, ONE launch for many tensors (the per-tensor launches are CPU-bound):
  :func:`fused_encode_many` and :func:`fused_mean_decode_update_many` take a list of tensors
  sharing ``group_key(layout, k, encoding) == (n1, n2, k, encoding)``; their ``idx``/``vals`` are
  the tensors' ``[B_i, k]`` rows concatenated in list order (:func:`group_block_offsets`), which
  one :func:`fused_pack_payload` / :func:`fused_unpack_payload` call (un)packs as one segment.
  Per-tensor data (addresses, columns, first block) comes from small cached device tables.

Blocks are numbered row-major over ``(R / n1, C / n2)``, the order of
:func:`flexdemo.dct.blocks_dct`, and a coefficient's index in its block is ``r * n2 + c``.
A tensor with leading dims is the ``[lead * R, C]`` matrix, which numbers blocks the same way.
Block sizes up to 64 are supported; sizes that are not powers of two (e.g. 48 rows for the
llama3 embedding shards) are padded to the next power of two with masked loads, zero rows
and columns in the padded DCT matrices, and padded positions excluded from the top-k.

Set ``TRITON_INTERPRET=1`` before importing triton to run the kernels on CPU tensors (slow;
for tests only).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from flexdemo.bitpack import bits_for, packed_nbytes
from flexdemo.codec import pack_payload, unpack_payload, value_nbytes
from flexdemo.dct import BlockLayout, dct_matrix

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except Exception:  # pragma: no cover - triton is a dependency, but keep the torch path usable
    _HAVE_TRITON = False

MAX_BLOCK = 64  # one 64x64 fp32 block is 32 registers per thread at 4 warps; larger would spill
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _pow2_at_least(n: int, floor: int = 16) -> int:
    # tl.arange needs powers of two and tl.dot needs every dim >= 16.
    p = floor
    while p < n:
        p *= 2
    return p


def fused_supported(layout: BlockLayout, device: torch.device | str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the fused kernels handle this layout on this device (else use the torch path).

    Needs a tensor with at least 2 dims (``[..., R, C]``, leading dims folded into rows),
    blocks of at most 64 x 64, fp32 data, and a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
    """
    device = torch.device(device)
    if not _HAVE_TRITON or dtype != torch.float32:
        return False
    if device.type != "cuda" and not (device.type == "cpu" and _INTERPRET):
        return False
    if len(layout.shape) < 2 or layout.num_blocks == 0:
        return False
    return 1 <= layout.n1 <= MAX_BLOCK and 1 <= layout.n2 <= MAX_BLOCK


_PADDED: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _padded_dct(n: int, p: int, device: torch.device) -> torch.Tensor:
    """``dct_matrix(n)`` in the top-left corner of a ``p x p`` zero matrix (fp32, contiguous)."""
    key = (n, p, torch.device(device))
    f = _PADDED.get(key)
    if f is None:
        f = torch.zeros(p, p, dtype=torch.float32, device=device)
        f[:n, :n] = dct_matrix(n, torch.float32, device)
        _PADDED[key] = f
    return f


def _num_warps(p1: int, p2: int) -> int:
    override = os.environ.get("FLEXDEMO_FUSED_WARPS")
    if override:
        return int(override)
    return 4 if p1 * p2 >= 2048 else 2


def _check(t: torch.Tensor, layout: BlockLayout, what: str) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"fused codec: {what} must be float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"fused codec: {what} must be contiguous")
    if tuple(t.shape) != tuple(layout.shape):
        raise ValueError(f"fused codec: {what} has shape {tuple(t.shape)}, layout says {layout.shape}")


if _HAVE_TRITON:

    @triton.jit
    def _flat_exclusive_cumsum(x):
        # Exclusive prefix sum of a 2-D int tile in row-major (flattened) order: a cumsum along
        # each row plus the total of all earlier rows. Avoids reshaping the tile to 1-D.
        row_incl = tl.cumsum(x, axis=1)
        row_tot = tl.sum(x, axis=1)
        row_off = tl.cumsum(row_tot, axis=0) - row_tot
        return row_off[:, None] + row_incl - x

    @triton.jit
    def _round_bf16(y):
        # fp32 -> nearest bf16 (ties to even) -> fp32, by integer rounding of the top 16 bits:
        # explicit because the interpreter's .to(tl.bfloat16) truncates. NaN passes through.
        u = y.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        return tl.where(y != y, y, u.to(tl.float32, bitcast=True))

    @triton.jit
    def _block_offsets(b, C, blocks_per_row, N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
        # Element offsets of block b in the row-major [rows, C] tensor, and the in-block mask.
        r = tl.arange(0, P1)
        c = tl.arange(0, P2)
        bi = b // blocks_per_row
        bj = b - bi * blocks_per_row
        rows = (bi * N1 + r).to(tl.int64)  # int64: tensors may exceed 2**31 elements
        offs = rows[:, None] * C + (bj * N2 + c)[None, :]
        valid = (r[:, None] < N1) & (c[None, :] < N2)
        return offs, valid, r, c

    @triton.jit
    def _idct_block(s, f1_ptr, f2_ptr, P1: tl.constexpr, P2: tl.constexpr, PREC: tl.constexpr):
        # F1^T @ s @ F2 (orthonormal basis: the transpose is the inverse).
        i1 = tl.arange(0, P1)
        i2 = tl.arange(0, P2)
        f1t = tl.load(f1_ptr + i1[None, :] * P1 + i1[:, None])  # f1t[i, r] = F1[r, i]
        f2 = tl.load(f2_ptr + i2[:, None] * P2 + i2[None, :])
        t = tl.dot(f1t, s, input_precision=PREC)
        return tl.dot(t, f2, input_precision=PREC)

    @triton.jit
    def _encode_block(
        b, row, delta_ptr, grad_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr,
        lr, decay, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr,
    ):
        # Block b of the tensor at delta_ptr; its idx/vals go to output row `row`.
        offs, valid, r, c = _block_offsets(b, C, blocks_per_row, N1, N2, P1, P2)

        # Momentum update, fused so delta is read and written exactly once.
        x = tl.load(delta_ptr + offs, mask=valid, other=0.0)
        if HAS_GRAD:
            g = tl.load(grad_ptr + offs, mask=valid, other=0.0)
            x = x * decay + g * lr
        else:
            x = x * decay

        # Forward DCT Y = F1 @ X @ F2^T (padding rows/cols of F are zero, so Y is zero there).
        f1 = tl.load(f1_ptr + r[:, None] * P1 + tl.arange(0, P1)[None, :])
        f2t = tl.load(f2_ptr + c[None, :] * P2 + tl.arange(0, P2)[:, None])  # f2t[j, c] = F2[c, j]
        y = tl.dot(tl.dot(f1, x, input_precision=PREC), f2t, input_precision=PREC)

        # Exact top-k by magnitude: the bits of a non-negative float order like the float, so
        # build the k-th largest |y| bit pattern from the top bit down, one counting pass per
        # bit. Invariant: cnt = count(bits >= thr) >= K. Stop early once cnt == K (thr then
        # separates the top K from the rest, usually after ~15 of the 31 bits).
        # Padding gets -1 so it is never counted.
        bits = tl.where(valid, tl.abs(y).to(tl.int32, bitcast=True), -1)
        thr = tl.full([], 0, tl.int32)
        cnt = tl.full([], N1 * N2, tl.int32)
        bit = tl.full([], 30, tl.int32)
        while (bit >= 0) & (cnt != K):
            cand = thr | (1 << bit)
            c_cand = tl.sum(tl.sum((bits >= cand).to(tl.int32), axis=1), axis=0)
            take = c_cand >= K
            thr = tl.where(take, cand, thr)
            cnt = tl.where(take, c_cand, cnt)
            bit -= 1
        sel = bits >= thr
        if cnt != K:
            # Ties at thr: all above it, then the lowest-index ties until K are taken.
            above = bits > thr
            tie = (bits == thr).to(tl.int32)
            need = K - tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0)
            sel = above | ((tie != 0) & (_flat_exclusive_cumsum(tie) < need))

        # Compaction: the j-th selected coefficient (in index order) goes to slot j.
        sel_i = sel.to(tl.int32)
        slot = row.to(tl.int64) * K + _flat_exclusive_cumsum(sel_i)
        flat = r[:, None] * N2 + c[None, :]
        tl.store(idx_ptr + slot, flat, mask=sel)
        tl.store(vals_ptr + slot, y, mask=sel)

        # Error feedback: remove what is sent (bf16 sends rounded values; fp32/sign count the
        # exact coefficient as sent, like flexdemo.codec.sent_values).
        if BF16:
            sent = _round_bf16(y)
        else:
            sent = y
        s = tl.where(sel, sent, 0.0)
        x = x - _idct_block(s, f1_ptr, f2_ptr, P1, P2, PREC)
        tl.store(delta_ptr + offs, x, mask=valid)

    @triton.jit
    def _encode_kernel(
        delta_ptr, grad_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr,
        lr, decay, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr,
    ):
        b = tl.program_id(0)
        _encode_block(b, b, delta_ptr, grad_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, C, blocks_per_row,
                      N1, N2, P1, P2, K, HAS_GRAD, BF16, PREC)

    @triton.jit
    def _sign_update(param_ptr, offs, valid, z, lr):
        # param -= lr * sign(z), with sign(0) == 0 like torch.sign.
        s = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
        p = tl.load(param_ptr + offs, mask=valid, other=0.0)
        tl.store(param_ptr + offs, p - s * lr, mask=valid)

    @triton.jit
    def _decode_kernel(
        param_ptr, mean_ptr, f1_ptr, f2_ptr, lr, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, PREC: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs, valid, r, c = _block_offsets(b, C, blocks_per_row, N1, N2, P1, P2)
        m = tl.load(mean_ptr + b.to(tl.int64) * (N1 * N2) + r[:, None] * N2 + c[None, :], mask=valid, other=0.0)
        _sign_update(param_ptr, offs, valid, _idct_block(m, f1_ptr, f2_ptr, P1, P2, PREC), lr)

    @triton.jit
    def _mean_decode_block(
        b, row, param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, C, blocks_per_row, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, PREC: tl.constexpr,
    ):
        # Block b of the tensor at param_ptr, from row `row` of each replica's [num_blocks, K] idx/vals.
        offs, valid, r, c = _block_offsets(b, C, blocks_per_row, N1, N2, P1, P2)
        j = tl.arange(0, KP)
        jm = j < K
        total = tl.zeros([P1, P2], dtype=tl.float32)
        count = tl.zeros([P1, P2], dtype=tl.float32)
        # Replicas in rank order, like mean_of_selected's scatter_adds: each coefficient's sum is
        # ((0 + v_0) + v_1) + ... over the replicas that picked it, the same bits on every rank.
        for w in range(W):
            base = (w * num_blocks + row).to(tl.int64) * K
            i = tl.load(idx_ptr + base + j, mask=jm, other=0).to(tl.int32)
            v = tl.load(vals_ptr + base + j, mask=jm, other=0.0)
            row_j = tl.where(jm, i // N2, -1)
            col_j = i - (i // N2) * N2
            on_row = r[:, None] == row_j[None, :]  # [P1, KP]
            on_col = (col_j[:, None] == c[None, :]).to(tl.float32)  # [KP, P2]
            # Densify by one-hot products: a replica's indices in a block are distinct, so each
            # output gets at most one nonzero term and the fp32 ("ieee") dot is exact.
            # (A non-finite value would spread NaN over its row; values are finite in practice.)
            v_w = tl.dot(tl.where(on_row, v[None, :], 0.0), on_col, input_precision="ieee")
            h_w = tl.dot(on_row.to(tl.float32), on_col, input_precision="ieee")
            total = tl.where(h_w > 0, total + v_w, total)
            count = count + h_w
        m = total / tl.maximum(count, 1.0)
        _sign_update(param_ptr, offs, valid, _idct_block(m, f1_ptr, f2_ptr, P1, P2, PREC), lr)

    @triton.jit
    def _mean_decode_kernel(
        param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, C, blocks_per_row, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, PREC: tl.constexpr,
    ):
        b = tl.program_id(0)
        _mean_decode_block(b, b, param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, C, blocks_per_row, num_blocks, W,
                           N1, N2, P1, P2, K, KP, PREC)

    # ---- Grouped (multi-tensor) kernels: one program per block of the whole group. --------------
    # Per-tensor data comes from small device tables: blk_tensor[g] (int32) is the tensor of group
    # block g; meta[t] = (cols, blocks_per_row, first group block) (int64); ptrs[t] holds raw
    # addresses (int64) that are cast back to pointers.

    @triton.jit
    def _group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED: tl.constexpr):
        t = tl.load(blk_tensor_ptr + g).to(tl.int64)
        C = tl.load(meta_ptr + t * 3).to(tl.int32)
        if ALIGNED:  # host-checked: every tensor's cols % 16 == 0 (lets loads vectorize, as per tensor)
            C = tl.multiple_of(C, 16)
        bpr = tl.load(meta_ptr + t * 3 + 1).to(tl.int32)
        b = (g - tl.load(meta_ptr + t * 3 + 2)).to(tl.int32)
        return t, b, C, bpr

    @triton.jit
    def _encode_many_kernel(
        ptr_tab, blk_tensor_ptr, meta_ptr, lr_tab, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, MIXED_GRAD: tl.constexpr, LR_TABLE: tl.constexpr,
        BF16: tl.constexpr, PREC: tl.constexpr, ALIGNED: tl.constexpr,
    ):
        g = tl.program_id(0)
        t, b, C, bpr = _group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED)
        delta_ptr = tl.load(ptr_tab + t * 2).to(tl.pointer_type(tl.float32))
        if ALIGNED:  # host-checked: every address % 16 == 0
            delta_ptr = tl.multiple_of(delta_ptr, 16)
        if LR_TABLE:
            lr = tl.load(lr_tab + t)
        if HAS_GRAD:
            g_addr = tl.load(ptr_tab + t * 2 + 1)
            grad_ptr = g_addr.to(tl.pointer_type(tl.float32))
            if ALIGNED:
                grad_ptr = tl.multiple_of(grad_ptr, 16)
            if MIXED_GRAD:
                if g_addr != 0:
                    _encode_block(b, g, delta_ptr, grad_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, C, bpr,
                                  N1, N2, P1, P2, K, True, BF16, PREC)
                else:
                    _encode_block(b, g, delta_ptr, delta_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, C, bpr,
                                  N1, N2, P1, P2, K, False, BF16, PREC)
            else:
                _encode_block(b, g, delta_ptr, grad_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, C, bpr,
                              N1, N2, P1, P2, K, True, BF16, PREC)
        else:
            _encode_block(b, g, delta_ptr, delta_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, C, bpr,
                          N1, N2, P1, P2, K, False, BF16, PREC)

    @triton.jit
    def _mean_decode_many_kernel(
        ptr_tab, blk_tensor_ptr, meta_ptr, lr_tab, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, LR_TABLE: tl.constexpr, PREC: tl.constexpr, ALIGNED: tl.constexpr,
    ):
        g = tl.program_id(0)
        t, b, C, bpr = _group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED)
        param_ptr = tl.load(ptr_tab + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            param_ptr = tl.multiple_of(param_ptr, 16)
        if LR_TABLE:
            lr = tl.load(lr_tab + t)
        _mean_decode_block(b, g, param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, C, bpr, num_blocks, W,
                           N1, N2, P1, P2, K, KP, PREC)

    @triton.jit
    def _pack_bits_kernel(src_ptr, out_ptr, n, nbytes, BITS: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr):
        # Output byte q holds stream bits 8q..8q+7; stream bit g is bit g % BITS of value g // BITS
        # (LSB first, as flexdemo.bitpack.pack_uint). SIGN packs the sign bits of fp32 values.
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
        src_ptr, src_stride, out_ptr, count, nbytes, BITS: tl.constexpr, SIGN: tl.constexpr, BLOCK: tl.constexpr
    ):
        # Value v of row w is stream bits v*BITS.. of that row: at most 3 bytes for BITS <= 17.
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
        if SIGN:
            tl.store(out_ptr + w * count + v, 1.0 - 2.0 * x.to(tl.float32), mask=m)  # 1 = negative
        else:
            tl.store(out_ptr + w * count + v, x, mask=m)


def _geometry(layout: BlockLayout, device):
    p1, p2 = _pow2_at_least(layout.n1), _pow2_at_least(layout.n2)
    return p1, p2, _padded_dct(layout.n1, p1, device), _padded_dct(layout.n2, p2, device), layout.cols // layout.n2


def fused_encode(
    delta: torch.Tensor,
    grad: torch.Tensor | None,
    lr: float,
    decay: float,
    layout: BlockLayout,
    k: int,
    encoding: str,
    *,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum update + DCT + top-k + error feedback of one tensor in one launch.

    ``delta`` (fp32, contiguous, ``layout.shape``) is updated in place to
    ``decay * delta + lr * grad - IDCT(sent)``; ``grad=None`` counts as zero. Returns
    ``idx`` [B, k] int32 (ascending within each block) and ``vals`` [B, k] fp32 (the exact
    coefficients, as :func:`flexdemo.codec.select_topk` gives them; pack with
    :func:`flexdemo.codec.pack_payload`). ``precision`` is tl.dot's input_precision:
    "ieee" (fp32, default), or "tf32x3"/"tf32" for speed at lower accuracy.
    """
    if not fused_supported(layout, delta.device, delta.dtype):
        raise ValueError(f"fused_encode: unsupported layout {layout} on {delta.device}")
    if encoding not in ("fp32", "bf16", "sign"):
        raise ValueError(f"unknown value_encoding {encoding!r}")
    if not 1 <= k <= layout.block_numel:
        raise ValueError(f"fused_encode: k={k} outside [1, {layout.block_numel}]")
    _check(delta, layout, "delta")
    if grad is not None:
        _check(grad, layout, "grad")
    B = layout.num_blocks
    p1, p2, f1, f2, bpr = _geometry(layout, delta.device)
    idx = torch.empty(B, k, dtype=torch.int32, device=delta.device)
    vals = torch.empty(B, k, dtype=torch.float32, device=delta.device)
    _encode_kernel[(B,)](
        delta, grad if grad is not None else delta, f1, f2, idx, vals,
        float(lr), float(decay), layout.cols, bpr,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, K=k,
        HAS_GRAD=grad is not None, BF16=encoding == "bf16", PREC=precision,
        num_warps=_num_warps(p1, p2),
    )
    return idx, vals


def fused_decode_update(
    param: torch.Tensor, dense_mean: torch.Tensor, lr: float, layout: BlockLayout, *, precision: str = "ieee"
) -> None:
    """``param -= lr * sign(IDCT(dense_mean))`` in place, ``dense_mean`` [B, n1*n2] fp32."""
    if not fused_supported(layout, param.device, param.dtype):
        raise ValueError(f"fused_decode_update: unsupported layout {layout} on {param.device}")
    _check(param, layout, "param")
    if tuple(dense_mean.shape) != (layout.num_blocks, layout.block_numel) or dense_mean.dtype != torch.float32:
        raise ValueError(f"fused_decode_update: dense_mean must be fp32 [{layout.num_blocks}, {layout.block_numel}]")
    dense_mean = dense_mean.contiguous()
    p1, p2, f1, f2, bpr = _geometry(layout, param.device)
    _decode_kernel[(layout.num_blocks,)](
        param, dense_mean, f1, f2, float(lr), layout.cols, bpr,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, PREC=precision, num_warps=_num_warps(p1, p2),
    )


def fused_mean_decode_update(
    param: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, lr: float, layout: BlockLayout,
    *, precision: str = "ieee",
) -> None:
    """``param -= lr * sign(IDCT(mean_of_selected(idx, vals)))`` without the dense mean.

    ``idx`` [W, B, k] (any int dtype, e.g. from ``unpack_payload``) and ``vals`` [W, B, k] fp32.
    The mean has the same bits as :func:`flexdemo.codec.mean_of_selected` (replicas summed in
    rank order, no atomics), so every rank updates identically. Cost grows with ``W * k``.
    Values must be finite (a NaN or inf value would make its whole block row NaN).
    """
    if not fused_supported(layout, param.device, param.dtype):
        raise ValueError(f"fused_mean_decode_update: unsupported layout {layout} on {param.device}")
    _check(param, layout, "param")
    W, B, k = idx.shape
    if B != layout.num_blocks or tuple(vals.shape) != (W, B, k) or vals.dtype != torch.float32:
        raise ValueError("fused_mean_decode_update: idx/vals must be [W, num_blocks, k], vals fp32")
    idx, vals = idx.contiguous(), vals.contiguous()
    p1, p2, f1, f2, bpr = _geometry(layout, param.device)
    _mean_decode_kernel[(B,)](
        param, idx, vals, f1, f2, float(lr), layout.cols, bpr, B, W,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, K=k, KP=_pow2_at_least(k), PREC=precision,
        num_warps=_num_warps(p1, p2),
    )


# ---- Grouped (multi-tensor) API -------------------------------------------------------------------
#
# One launch per group of tensors that share the kernels' compile-time geometry (see group_key).
# The per-tensor data (addresses, columns, blocks per row, first block) lives in small device tables,
# built once and cached: layout tables by the layouts, address tables by the data_ptrs.

_TABLE_CACHE_SIZE = 256
_LAYOUT_TABLES: OrderedDict = OrderedDict()
_PTR_TABLES: OrderedDict = OrderedDict()


def group_key(layout: BlockLayout, k: int, encoding: str) -> tuple[int, int, int, str]:
    """Tensors with equal keys can share one grouped launch: ``(n1, n2, k, encoding)``.

    ``k`` must be the per-block top-k actually used (already clamped to ``block_numel``).
    The ``precision`` of a call is the same for the whole group by construction.
    """
    return (layout.n1, layout.n2, int(k), encoding)


def group_block_offsets(layouts: list[BlockLayout]) -> list[int]:
    """``offsets`` (length ``len(layouts) + 1``): tensor i's blocks are rows ``offsets[i]:offsets[i+1]``
    of the grouped ``idx``/``vals``."""
    out = [0]
    for L in layouts:
        out.append(out[-1] + L.num_blocks)
    return out


def _cache_get(cache: OrderedDict, key):
    v = cache.get(key)
    if v is not None:
        cache.move_to_end(key)
    return v


def _cache_put(cache: OrderedDict, key, value):
    cache[key] = value
    if len(cache) > _TABLE_CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _device_table(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        # Pinned + non_blocking: no host sync (the caching host allocator keeps the staging buffer
        # alive until the copy has run).
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _layout_tables(layouts: list[BlockLayout], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """(blk_tensor int32 [total_blocks], meta int64 [T, 3] = (cols, blocks_per_row, first block), total,
    whether every cols % 16 == 0)."""
    key = (device, tuple((L.shape, L.n1, L.n2) for L in layouts))
    hit = _cache_get(_LAYOUT_TABLES, key)
    if hit is not None:
        return hit
    offsets = group_block_offsets(layouts)
    total = offsets[-1]
    if total >= 2**31:
        raise ValueError(f"fused grouped codec: {total} blocks in one group (max 2**31 - 1); split the group")
    meta = [(L.cols, L.cols // L.n2, offsets[i]) for i, L in enumerate(layouts)]
    counts = torch.tensor([L.num_blocks for L in layouts], dtype=torch.int64)
    blk_tensor = torch.repeat_interleave(torch.arange(len(layouts), dtype=torch.int32), counts, output_size=total)
    if device.type == "cuda":
        blk_tensor = blk_tensor.pin_memory().to(device, non_blocking=True)
    aligned = all(L.cols % 16 == 0 for L in layouts)
    return _cache_put(_LAYOUT_TABLES, key, (blk_tensor, _device_table(meta, torch.int64, device), total, aligned))


def _ptr_table(addrs: tuple, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(int64 table of the addresses, whether all are 16-byte aligned)."""
    key = (device, addrs)
    hit = _cache_get(_PTR_TABLES, key)
    if hit is not None:
        return hit
    aligned = all(a % 16 == 0 for a in addrs)
    return _cache_put(_PTR_TABLES, key, (_device_table(list(addrs), torch.int64, device), aligned))


def _align_hints(cols_aligned: bool, ptrs_aligned: bool) -> bool:
    # FLEXDEMO_GROUPED_HINTS=0 turns the divisibility hints off (A/B on the GPU; results are the same).
    return cols_aligned and ptrs_aligned and os.environ.get("FLEXDEMO_GROUPED_HINTS", "1") != "0"


def _lr_arg(lr, n: int, device: torch.device):
    """(scalar lr, lr table or None): a float is passed as a kernel scalar, a sequence as a fp32 table."""
    if isinstance(lr, (int, float)):
        return float(lr), None
    if isinstance(lr, torch.Tensor):
        t = lr.to(device=device, dtype=torch.float32).reshape(-1)
    else:
        t = _device_table([float(x) for x in lr], torch.float32, device)
    if t.numel() != n:
        raise ValueError(f"fused grouped codec: {t.numel()} learning rates for {n} tensors")
    return 0.0, t.contiguous()


def _check_group(tensors: list[torch.Tensor], layouts: list[BlockLayout], what: str) -> torch.device:
    if len(tensors) != len(layouts) or not tensors:
        raise ValueError(f"fused grouped codec: need one layout per {what} (and at least one), "
                         f"got {len(tensors)} tensors and {len(layouts)} layouts")
    device = tensors[0].device
    n1, n2 = layouts[0].n1, layouts[0].n2
    for t, L in zip(tensors, layouts):
        if L.n1 != n1 or L.n2 != n2:
            raise ValueError(f"fused grouped codec: blocks {L.n1}x{L.n2} in a group of {n1}x{n2} (see group_key)")
        if t.device != device:
            raise ValueError(f"fused grouped codec: {what} on {t.device} and {device} in one group")
        if not fused_supported(L, device, t.dtype):
            raise ValueError(f"fused grouped codec: unsupported layout {L} on {device}")
        _check(t, L, what)
    return device


def fused_encode_many(
    deltas: list[torch.Tensor],
    grads: list[torch.Tensor | None],
    lr,
    decay: float,
    layouts: list[BlockLayout],
    k: int,
    encoding: str,
    *,
    precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_encode` of many tensors with equal blocks ``n1 x n2``, in ONE launch.

    Returns ``idx`` [total_blocks, k] int32 and ``vals`` [total_blocks, k] fp32 with tensor i's
    blocks in rows ``offsets[i]:offsets[i+1]`` (:func:`group_block_offsets`); each ``deltas[i]`` is
    updated in place. Bitwise the same as calling :func:`fused_encode` per tensor. ``grads[i]`` may
    be None (zero gradient). ``lr`` is a float, or one per tensor (a sequence or fp32 tensor).
    """
    if encoding not in ("fp32", "bf16", "sign"):
        raise ValueError(f"unknown value_encoding {encoding!r}")
    if len(grads) != len(deltas):
        raise ValueError("fused_encode_many: need one grad (or None) per delta")
    device = _check_group(deltas, layouts, "delta")
    L0 = layouts[0]
    if not 1 <= k <= L0.block_numel:
        raise ValueError(f"fused_encode_many: k={k} outside [1, {L0.block_numel}]")
    for g, L in zip(grads, layouts):
        if g is not None:
            if g.device != device:
                raise ValueError(f"fused_encode_many: grad on {g.device}, delta on {device}")
            _check(g, L, "grad")
    n_grad = sum(g is not None for g in grads)
    blk_tensor, meta, total, cols_aligned = _layout_tables(layouts, device)
    addrs = []
    for d, g in zip(deltas, grads):
        addrs.append(d.data_ptr())
        addrs.append(g.data_ptr() if g is not None else 0)
    ptrs, ptrs_aligned = _ptr_table(tuple(addrs), device)
    lr_s, lr_tab = _lr_arg(lr, len(deltas), device)
    p1, p2 = _pow2_at_least(L0.n1), _pow2_at_least(L0.n2)
    f1, f2 = _padded_dct(L0.n1, p1, device), _padded_dct(L0.n2, p2, device)
    idx = torch.empty(total, k, dtype=torch.int32, device=device)
    vals = torch.empty(total, k, dtype=torch.float32, device=device)
    _encode_many_kernel[(total,)](
        ptrs, blk_tensor, meta, lr_tab if lr_tab is not None else f1, f1, f2, idx, vals,
        lr_s, float(decay),
        N1=L0.n1, N2=L0.n2, P1=p1, P2=p2, K=k,
        HAS_GRAD=n_grad > 0, MIXED_GRAD=0 < n_grad < len(grads), LR_TABLE=lr_tab is not None,
        BF16=encoding == "bf16", PREC=precision, ALIGNED=_align_hints(cols_aligned, ptrs_aligned),
        num_warps=_num_warps(p1, p2),
    )
    return idx, vals


def fused_mean_decode_update_many(
    params: list[torch.Tensor],
    idx: torch.Tensor,
    vals: torch.Tensor,
    lr,
    layouts: list[BlockLayout],
    *,
    precision: str = "ieee",
) -> None:
    """:func:`fused_mean_decode_update` of many tensors with equal blocks ``n1 x n2``, in ONE launch.

    ``idx`` [W, total_blocks, k] (any int dtype; e.g. :func:`fused_unpack_payload` of the group's
    segment) and ``vals`` [W, total_blocks, k] fp32, tensor i's blocks in rows
    ``offsets[i]:offsets[i+1]`` (:func:`group_block_offsets`). Each ``params[i]`` is updated in
    place, bitwise as by :func:`fused_mean_decode_update`. ``lr``: a float, or one per tensor.
    """
    device = _check_group(params, layouts, "param")
    blk_tensor, meta, total, cols_aligned = _layout_tables(layouts, device)
    if idx.dim() != 3:
        raise ValueError("fused_mean_decode_update_many: idx/vals must be [W, total_blocks, k]")
    W, B, k = idx.shape
    if B != total or tuple(vals.shape) != (W, B, k) or vals.dtype != torch.float32:
        raise ValueError(f"fused_mean_decode_update_many: idx/vals must be [W, {total}, k], vals fp32; "
                         f"got {tuple(idx.shape)} and {tuple(vals.shape)} {vals.dtype}")
    if idx.device != device or vals.device != device:
        raise ValueError("fused_mean_decode_update_many: idx/vals on another device than params")
    idx, vals = idx.contiguous(), vals.contiguous()
    ptrs, ptrs_aligned = _ptr_table(tuple(p.data_ptr() for p in params), device)
    lr_s, lr_tab = _lr_arg(lr, len(params), device)
    L0 = layouts[0]
    p1, p2 = _pow2_at_least(L0.n1), _pow2_at_least(L0.n2)
    f1, f2 = _padded_dct(L0.n1, p1, device), _padded_dct(L0.n2, p2, device)
    _mean_decode_many_kernel[(total,)](
        ptrs, blk_tensor, meta, lr_tab if lr_tab is not None else f1, idx, vals, f1, f2, lr_s, total, W,
        N1=L0.n1, N2=L0.n2, P1=p1, P2=p2, K=k, KP=_pow2_at_least(k),
        LR_TABLE=lr_tab is not None, PREC=precision, ALIGNED=_align_hints(cols_aligned, ptrs_aligned),
        num_warps=_num_warps(p1, p2),
    )


_PACK_BLOCK = 1024


def _bitpack_device_ok(t: torch.Tensor) -> bool:
    return _HAVE_TRITON and (t.device.type == "cuda" or (t.device.type == "cpu" and _INTERPRET))


def fused_pack_payload(
    idx: torch.Tensor, vals: torch.Tensor, block_numel: int, encoding: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Same bytes as :func:`flexdemo.codec.pack_payload`, with one Triton launch per bit stream.

    ``out`` (uint8, ``payload_nbytes`` long, e.g. a slice of the step's send buffer) is filled
    and returned when given, which saves the final concatenation.
    """
    if not _bitpack_device_ok(idx):
        return pack_payload(idx, vals, block_numel, encoding)
    bits = bits_for(block_numel)
    n = idx.numel()
    idx_bytes = packed_nbytes(n, bits)
    total = idx_bytes + value_nbytes(n, encoding)
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=idx.device)
    elif out.dtype != torch.uint8 or out.numel() != total or not out.is_contiguous():
        raise ValueError(f"fused_pack_payload: out must be {total} contiguous uint8")
    flat_idx, flat_vals = idx.reshape(-1).contiguous(), vals.reshape(-1).contiguous()
    if bits > 0 and idx_bytes:
        _pack_bits_kernel[(triton.cdiv(idx_bytes, _PACK_BLOCK),)](
            flat_idx, out, n, idx_bytes, BITS=bits, SIGN=False, BLOCK=_PACK_BLOCK)
    val_out = out[idx_bytes:]
    if encoding == "fp32":
        val_out.copy_(flat_vals.to(torch.float32).view(torch.uint8))
    elif encoding == "bf16":
        val_out.copy_(flat_vals.to(torch.bfloat16).view(torch.uint8))
    elif val_out.numel():
        _pack_bits_kernel[(triton.cdiv(val_out.numel(), _PACK_BLOCK),)](
            flat_vals.to(torch.float32), val_out, n, val_out.numel(), BITS=1, SIGN=True, BLOCK=_PACK_BLOCK)
    return out


def fused_unpack_payload(
    payload: torch.Tensor, num_blocks: int, k: int, block_numel: int, encoding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`flexdemo.codec.unpack_payload` for fp32 values, but ``idx`` is int32.

    ``payload`` is ``[W, nbytes]`` with unit stride along bytes (a column slice of the
    gathered buffer is fine). Returns ``idx`` [W, B, k] int32 and ``vals`` [W, B, k] fp32.
    """
    if not _bitpack_device_ok(payload):
        i, v = unpack_payload(payload, num_blocks, k, block_numel, encoding, torch.float32)
        return i.to(torch.int32), v
    W, count, bits = payload.shape[0], num_blocks * k, bits_for(block_numel)
    if payload.stride(1) != 1:
        payload = payload.contiguous()
    idx_bytes = packed_nbytes(count, bits)
    idx = torch.zeros(W, num_blocks, k, dtype=torch.int32, device=payload.device)
    grid = (triton.cdiv(count, _PACK_BLOCK), W)
    if bits > 0 and count:
        _unpack_bits_kernel[grid](payload, payload.stride(0), idx, count, idx_bytes,
                                  BITS=bits, SIGN=False, BLOCK=_PACK_BLOCK)
    raw = payload[:, idx_bytes:]
    if encoding == "sign":
        vals = torch.empty(W, num_blocks, k, dtype=torch.float32, device=payload.device)
        if count:
            # The unpack kernel takes a base pointer: pass the value region via its own view.
            _unpack_bits_kernel[grid](raw, payload.stride(0), vals, count, raw.shape[1],
                                      BITS=1, SIGN=True, BLOCK=_PACK_BLOCK)
    else:
        # A fresh buffer: the values may start at any byte and view() needs alignment.
        flat = raw.reshape(-1).clone()  # clone: a W == 1 slice would keep its odd offset
        vals = flat.view(torch.float32 if encoding == "fp32" else torch.bfloat16).to(torch.float32)
        vals = vals.reshape(W, num_blocks, k)
    return idx, vals
