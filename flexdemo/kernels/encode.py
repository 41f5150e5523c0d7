"""Fused encode: momentum update + chunked DCT + exact top-k + error feedback, one block per program.

The torch path (:func:`flexdemo.compression.codec.compress`) makes many passes over the
accumulator: DCT matmuls, block transposes, abs, topk, a scatter into zeros, the IDCT, the
subtraction. Here each program does all of it for one ``n1 x n2`` block in registers:
``x = decay * x + lr * grad``; ``Y = F1 @ X @ F2^T``; exact top-k of ``|Y|`` (ties broken by the
lowest index); the kept values as the value encoding sends them; error feedback
``x -= F1^T @ S @ F2`` with ``S`` what is counted as sent; ``x`` written back in place.
"""

from __future__ import annotations

import torch

from flexdemo.kernels.common import (
    HAVE_TRITON,
    check_tensor,
    device_capability,
    fused_supported,
    geometry,
    launch_options,
    padded_dct,
    pow2_at_least,
    search_bracket,
    sparse_plan,
)
from flexdemo.kernels.tables import align_hints, check_group, layout_tables, lr_arg, ptr_table
from flexdemo.wire.dct import BlockLayout
from flexdemo.wire.format import check_encoding

# How the kept values leave the kernel (a constexpr): exact (fp32, sign), rounded to bf16 for
# error feedback (bf16), or replaced by +-(mean |kept|) of their block (scaled_sign).
_VALUES_EXACT, _VALUES_BF16, _VALUES_SCALED_SIGN = 0, 1, 2


def _values_mode(encoding: str) -> int:
    check_encoding(encoding)
    return {"bf16": _VALUES_BF16, "scaled_sign": _VALUES_SCALED_SIGN}.get(encoding, _VALUES_EXACT)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from flexdemo.kernels.common import (
        block_offsets,
        flat_exclusive_cumsum,
        idct_block,
        round_bf16,
        sparse_idct,
        topk_threshold,
    )
    from flexdemo.kernels.tables import group_locate

    @triton.jit
    def _encode_block(
        b, row, delta_ptr, grad_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr,
        lr, decay, R, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, VALUES: tl.constexpr, PREC: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, SPARSE_EF: tl.constexpr, BRACKET: tl.constexpr,
        SKIP_FLAG: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        # Block b of the tensor at delta_ptr; its idx/vals go to output row `row`.
        base, offs, valid, inblock, r, c = block_offsets(b, R, C, blocks_per_row, N1, N2, P1, P2, PARTIAL)
        delta_ptr += base
        grad_ptr += base

        # Momentum update, fused so delta is read and written exactly once.
        x = tl.load(delta_ptr + offs, mask=valid, other=0.0)
        if HAS_GRAD:
            g = tl.load(grad_ptr + offs, mask=valid, other=0.0)
            if SKIP_FLAG:  # a device flag != 0: the grads count as zero (a replica's non-finite step)
                g = tl.where(tl.load(skip_ptr) != 0, 0.0, g)
            x = x * decay + g * lr
        else:
            x = x * decay

        # Forward DCT Y = F1 @ X @ F2^T (padding rows/cols of F are zero, so Y is zero there).
        f1 = tl.load(f1_ptr + r[:, None] * P1 + tl.arange(0, P1)[None, :])
        f2t = tl.load(f2_ptr + c[None, :] * P2 + tl.arange(0, P2)[:, None])  # f2t[j, c] = F2[c, j]
        y = tl.dot(tl.dot(f1, x, input_precision=PREC), f2t, input_precision=PREC)

        # Exact top-k by magnitude: the bits of a non-negative float order like the float, so
        # the k-th largest |y| is found as a bit pattern (common.topk_threshold). Positions
        # outside the n1 x n2 block (power-of-two padding) get -1 so they are never counted.
        bits = tl.where(inblock, tl.abs(y).to(tl.int32, bitcast=True), -1)
        thr, cnt = topk_threshold(bits, K, N1 * N2, BRACKET)
        sel = bits >= thr
        if cnt != K:
            # Ties at thr: all above it, then the lowest-index ties until K are taken.
            above = bits > thr
            tie = (bits == thr).to(tl.int32)
            need = K - tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0)
            sel = above | ((tie != 0) & (flat_exclusive_cumsum(tie) < need))

        # The values as sent and as error feedback counts them (flexdemo.compression.codec):
        # fp32/sign: the exact coefficient; bf16: rounded; scaled_sign: +-(mean |kept non-zero|).
        # A kept zero (bits 0) casts no vote and stays zero.
        if VALUES == 2:
            voters = tl.sum(tl.sum((sel & (bits > 0)).to(tl.int32), axis=1), axis=0)
            mag = tl.sum(tl.sum(tl.where(sel, tl.abs(y), 0.0), axis=1), axis=0) / tl.maximum(voters, 1).to(tl.float32)
            negative = y.to(tl.int32, bitcast=True) < 0  # the sign bit, like torch.signbit
            y = tl.where(bits == 0, 0.0, tl.where(negative, -mag, mag))
            sent = y
        elif VALUES == 1:
            sent = round_bf16(y)
        else:
            sent = y

        # Compaction: the j-th selected coefficient (in index order) goes to slot j of this
        # block's output row (a scalar base and int32 slots: no 64-bit math per element).
        idx_row = idx_ptr + row.to(tl.int64) * K
        vals_row = vals_ptr + row.to(tl.int64) * K
        slot = flat_exclusive_cumsum(sel.to(tl.int32))
        flat = r[:, None] * N2 + c[None, :]
        tl.store(idx_row + slot, flat, mask=sel)
        tl.store(vals_row + slot, y, mask=sel)

        # Error feedback: remove what counts as sent.
        if SPARSE_EF:
            # From the compacted idx/vals just stored (a barrier makes every thread's stores
            # visible to the block): K gathered basis functions instead of two dense products.
            tl.debug_barrier()
            for k0 in tl.static_range(0, KP, KC):
                j = k0 + tl.arange(0, KC)
                i = tl.load(idx_row + j, mask=j < K, other=-1)
                v = tl.load(vals_row + j, mask=j < K, other=0.0)
                if VALUES == 1:
                    v = round_bf16(v)
                x = x - sparse_idct(i, v, f1_ptr, f2_ptr, N2, P1, P2, PREC)
        else:
            x = x - idct_block(tl.where(sel, sent, 0.0), f1_ptr, f2_ptr, P1, P2, PREC)
        tl.store(delta_ptr + offs, x, mask=valid)

    @triton.jit
    def _encode_kernel(
        delta_ptr, grad_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr,
        lr, decay, R, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, VALUES: tl.constexpr, PREC: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, SPARSE_EF: tl.constexpr, BRACKET: tl.constexpr,
        SKIP_FLAG: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        b = tl.program_id(0)
        _encode_block(b, b, delta_ptr, grad_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, R, C,
                      blocks_per_row, N1, N2, P1, P2, K, HAS_GRAD, VALUES, PREC, KP, KC, SPARSE_EF, BRACKET, SKIP_FLAG, PARTIAL)

    @triton.jit
    def _encode_many_kernel(
        ptr_tab, blk_tensor_ptr, meta_ptr, lr_tab, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        HAS_GRAD: tl.constexpr, MIXED_GRAD: tl.constexpr, LR_TABLE: tl.constexpr,
        VALUES: tl.constexpr, PREC: tl.constexpr, ALIGNED: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, SPARSE_EF: tl.constexpr, BRACKET: tl.constexpr,
        SKIP_FLAG: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        g = tl.program_id(0)
        t, b, R, C, bpr = group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED)
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
                    _encode_block(b, g, delta_ptr, grad_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay,
                                  R, C, bpr, N1, N2, P1, P2, K, True, VALUES, PREC, KP, KC, SPARSE_EF, BRACKET, SKIP_FLAG, PARTIAL)
                else:
                    _encode_block(b, g, delta_ptr, delta_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay,
                                  R, C, bpr, N1, N2, P1, P2, K, False, VALUES, PREC, KP, KC, SPARSE_EF, BRACKET, SKIP_FLAG, PARTIAL)
            else:
                _encode_block(b, g, delta_ptr, grad_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, R, C, bpr,
                              N1, N2, P1, P2, K, True, VALUES, PREC, KP, KC, SPARSE_EF, BRACKET, SKIP_FLAG, PARTIAL)
        else:
            _encode_block(b, g, delta_ptr, delta_ptr, skip_ptr, f1_ptr, f2_ptr, idx_ptr, vals_ptr, lr, decay, R, C, bpr,
                          N1, N2, P1, P2, K, False, VALUES, PREC, KP, KC, SPARSE_EF, BRACKET, SKIP_FLAG, PARTIAL)


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
    skip_grad: torch.Tensor | None = None,
    bracket: bool | None = None,
    maxnreg: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Momentum update + DCT + top-k + error feedback of one tensor in one launch.

    ``delta`` (fp32, contiguous, ``layout.shape``) is updated in place to
    ``decay * delta + lr * grad - IDCT(sent)``; ``grad=None`` counts as zero. Returns
    ``idx`` [B, k] int32 (ascending within each block) and ``vals`` [B, k] fp32: the exact
    coefficients (``scaled_sign``: +-(mean |kept|) of the block), as
    :func:`flexdemo.compression.codec.compress` gives them; pack with
    :func:`flexdemo.kernels.pack.fused_pack_payload`. ``precision`` is tl.dot's
    input_precision: "ieee" (fp32, default), or "tf32x3"/"tf32" for speed at lower accuracy.
    ``skip_grad``: a one-element tensor on the device; where it is nonzero when the kernel runs,
    ``grad`` counts as zero (read on the device: the caller need not sync to decide).
    ``bracket`` and ``maxnreg``, for tests and timing only (the library leaves them None): the
    top-k search from the row-max bracket or from the top bit (None: common.search_bracket's
    choice; True needs ``k <= layout.n1``), and a register ceiling (None: common.launch_options's
    choice). Neither changes the results (tested).
    """
    if not fused_supported(layout, delta.device, delta.dtype):
        raise ValueError(f"fused_encode: unsupported layout {layout} on {delta.device}")
    values = _values_mode(encoding)
    if not 1 <= k <= layout.block_numel:
        raise ValueError(f"fused_encode: k={k} outside [1, {layout.block_numel}]")
    check_tensor(delta, layout, "delta")
    if grad is not None:
        check_tensor(grad, layout, "grad")
    _check_skip(skip_grad, delta.device, "fused_encode")
    if bracket is None:
        bracket = search_bracket(k, layout.n1)
    elif bracket and k > layout.n1:
        raise ValueError(f"fused_encode: the bracket search needs k <= {layout.n1} rows, got k={k}")
    B = layout.num_blocks
    p1, p2, f1, f2, bpr = geometry(layout, delta.device)
    idx = torch.empty(B, k, dtype=torch.int32, device=delta.device)
    vals = torch.empty(B, k, dtype=torch.float32, device=delta.device)
    _encode_kernel[(B,)](
        delta, grad if grad is not None else delta, skip_grad if skip_grad is not None else f1, f1, f2, idx, vals,
        float(lr), float(decay), layout.rows, layout.cols, bpr,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, K=k,
        HAS_GRAD=grad is not None, VALUES=values, PREC=precision, **sparse_plan(k, p1, p2),
        BRACKET=bool(bracket), SKIP_FLAG=skip_grad is not None and grad is not None,
        PARTIAL=layout.padded,
        **launch_options("encode", p1, p2, device_capability(delta.device), maxnreg=maxnreg),
    )
    return idx, vals


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
    skip_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_encode` of many tensors with equal blocks ``n1 x n2``, in ONE launch.

    Returns ``idx`` [total_blocks, k] int32 and ``vals`` [total_blocks, k] fp32 with tensor i's
    blocks in rows ``offsets[i]:offsets[i+1]`` (:func:`flexdemo.kernels.tables.group_block_offsets`);
    each ``deltas[i]`` is updated in place. Bitwise the same as calling :func:`fused_encode` per
    tensor. ``grads[i]`` may be None (zero gradient). ``lr`` is a float, or one per tensor (a
    sequence or fp32 tensor). ``skip_grad``: as in :func:`fused_encode`, for every tensor.
    """
    values = _values_mode(encoding)
    if len(grads) != len(deltas):
        raise ValueError("fused_encode_many: need one grad (or None) per delta")
    device = check_group(deltas, layouts, "delta")
    L0 = layouts[0]
    if not 1 <= k <= L0.block_numel:
        raise ValueError(f"fused_encode_many: k={k} outside [1, {L0.block_numel}]")
    for g, L in zip(grads, layouts):
        if g is not None:
            if g.device != device:
                raise ValueError(f"fused_encode_many: grad on {g.device}, delta on {device}")
            check_tensor(g, L, "grad")
    _check_skip(skip_grad, device, "fused_encode_many")
    n_grad = sum(g is not None for g in grads)
    blk_tensor, meta, total, cols_aligned = layout_tables(layouts, device)
    addrs = []
    for d, g in zip(deltas, grads):
        addrs.append(d.data_ptr())
        addrs.append(g.data_ptr() if g is not None else 0)
    ptrs, ptrs_aligned = ptr_table(tuple(addrs), device)
    lr_s, lr_tab = lr_arg(lr, len(deltas), device)
    p1, p2 = pow2_at_least(L0.n1), pow2_at_least(L0.n2)
    f1, f2 = padded_dct(L0.n1, p1, device), padded_dct(L0.n2, p2, device)
    idx = torch.empty(total, k, dtype=torch.int32, device=device)
    vals = torch.empty(total, k, dtype=torch.float32, device=device)
    _encode_many_kernel[(total,)](
        ptrs, blk_tensor, meta, lr_tab if lr_tab is not None else f1, skip_grad if skip_grad is not None else f1,
        f1, f2, idx, vals,
        lr_s, float(decay),
        N1=L0.n1, N2=L0.n2, P1=p1, P2=p2, K=k,
        HAS_GRAD=n_grad > 0, MIXED_GRAD=0 < n_grad < len(grads), LR_TABLE=lr_tab is not None,
        VALUES=values, PREC=precision, ALIGNED=align_hints(cols_aligned, ptrs_aligned), **sparse_plan(k, p1, p2),
        BRACKET=search_bracket(k, L0.n1), SKIP_FLAG=skip_grad is not None and n_grad > 0,
        PARTIAL=any(L.padded for L in layouts),
        **launch_options("encode", p1, p2, device_capability(device)),
    )
    return idx, vals


def _check_skip(skip: torch.Tensor | None, device: torch.device, what: str) -> None:
    if skip is not None and (skip.numel() != 1 or skip.device != device or skip.dtype != torch.float32):
        raise ValueError(f"{what}: skip_grad must be one fp32 element on {device}, got "
                         f"{tuple(skip.shape)} {skip.dtype} on {skip.device}")
