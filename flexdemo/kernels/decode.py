"""Fused decode: mean over the replicas that voted for each coefficient + inverse DCT, then
either the sign update ``param -= lr * sign(.)`` (per-step DeMo) or the decoded tensor
itself (the outer step of ``demo_diloco``), one block per program.

Each kept coefficient enters the inverse DCT as its basis function (gathered rows of the DCT
matrices) weighted by value / (replicas that kept it): replicas in rank order, no atomics, so
every rank decodes the same bits; the result equals IDCT(:func:`flexdemo.compression.codec.
mean_of_selected`) up to fp32 rounding, and no dense mean is built. Cost grows with ``W * k``
(the overlap count with ``(W * k)**2``). Values must be finite (a NaN or inf value would make
its whole block NaN).
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
    num_warps,
    padded_dct,
    pow2_at_least,
    sparse_plan,
)
from flexdemo.kernels.tables import align_hints, check_group, layout_tables, lr_arg, ptr_table
from flexdemo.wire.dct import BlockLayout

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from flexdemo.kernels.common import block_offsets, idct_block, sparse_idct
    from flexdemo.kernels.tables import group_locate

    @triton.jit
    def _apply(out_ptr, offs, valid, z, lr, scale, SIGN_UPDATE: tl.constexpr):
        if SIGN_UPDATE:
            # out = out * scale - lr * sign(z), with sign(0) == 0 like torch.sign; scale: the
            # step's decoupled weight decay, fused here to save a pass over the parameters.
            s = tl.where(z > 0, 1.0, tl.where(z < 0, -1.0, 0.0))
            p = tl.load(out_ptr + offs, mask=valid, other=0.0)
            tl.store(out_ptr + offs, p * scale - s * lr, mask=valid)
        else:
            tl.store(out_ptr + offs, z, mask=valid)

    @triton.jit
    def _decode_kernel(
        param_ptr, mean_ptr, f1_ptr, f2_ptr, lr, R, C, blocks_per_row,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, PREC: tl.constexpr,
        PARTIAL: tl.constexpr,
    ):
        b = tl.program_id(0)
        base, offs, valid, inblock, r, c = block_offsets(b, R, C, blocks_per_row, N1, N2, P1, P2, PARTIAL)
        param_ptr += base
        m = tl.load(mean_ptr + b.to(tl.int64) * (N1 * N2) + r[:, None] * N2 + c[None, :], mask=inblock, other=0.0)
        _apply(param_ptr, offs, valid, idct_block(m, f1_ptr, f2_ptr, P1, P2, PREC), lr, 1.0, True)

    @triton.jit
    def _mean_decode_block(
        b, row, out_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, scale, R, C, blocks_per_row, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr, SIGN_UPDATE: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        # Block b of the tensor at out_ptr, from row `row` of each replica's [num_blocks, K] idx/vals.
        block_base, offs, valid, inblock, r, c = block_offsets(b, R, C, blocks_per_row, N1, N2, P1, P2, PARTIAL)
        out_ptr += block_base
        # IDCT(mean over the replicas that voted for each coefficient) = sum over every replica's
        # kept coefficients of value / (how many replicas kept it) times its basis function:
        # no dense mean tile is built. KC coefficients per product (common.sparse_idct). A slot
        # that casts no vote has index -1 (value 0): it adds nothing and matches no voter.
        z = tl.zeros([P1, P2], dtype=tl.float32)
        for w in range(W):
            base = (w * num_blocks + row).to(tl.int64) * K
            for k0 in tl.static_range(0, KP, KC):
                j = k0 + tl.arange(0, KC)
                i = tl.load(idx_ptr + base + j, mask=j < K, other=-1).to(tl.int32)
                v = tl.load(vals_ptr + base + j, mask=j < K, other=0.0)
                n = tl.zeros([KC], dtype=tl.int32)  # replicas that kept i[j], this one included
                for u in range(W):
                    base_u = (u * num_blocks + row).to(tl.int64) * K
                    for q0 in tl.static_range(0, KP, KC):
                        q = q0 + tl.arange(0, KC)
                        iu = tl.load(idx_ptr + base_u + q, mask=q < K, other=-2).to(tl.int32)
                        n += tl.sum((i[:, None] == iu[None, :]).to(tl.int32), axis=1)
                z += sparse_idct(i, v / tl.maximum(n, 1).to(tl.float32), f1_ptr, f2_ptr, N2, P1, P2, PREC)
        _apply(out_ptr, offs, valid, z, lr, scale, SIGN_UPDATE)

    @triton.jit
    def _mean_decode_kernel(
        param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, R, C, blocks_per_row, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, PREC: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        b = tl.program_id(0)
        _mean_decode_block(b, b, param_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, 1.0, R, C, blocks_per_row,
                           num_blocks, W, N1, N2, P1, P2, K, KP, KC, PREC, True, PARTIAL)

    @triton.jit
    def _mean_decode_many_kernel(
        ptr_tab, blk_tensor_ptr, meta_ptr, lr_tab, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, scale, num_blocks, W,
        N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, KC: tl.constexpr, LR_TABLE: tl.constexpr, PREC: tl.constexpr, ALIGNED: tl.constexpr,
        SIGN_UPDATE: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        g = tl.program_id(0)
        t, b, R, C, bpr = group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED)
        out_ptr = tl.load(ptr_tab + t).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            out_ptr = tl.multiple_of(out_ptr, 16)
        if LR_TABLE:
            lr = tl.load(lr_tab + t)
        _mean_decode_block(b, g, out_ptr, idx_ptr, vals_ptr, f1_ptr, f2_ptr, lr, scale, R, C, bpr, num_blocks, W,
                           N1, N2, P1, P2, K, KP, KC, PREC, SIGN_UPDATE, PARTIAL)


def fused_decode_update(
    param: torch.Tensor, dense_mean: torch.Tensor, lr: float, layout: BlockLayout, *, precision: str = "ieee"
) -> None:
    """``param -= lr * sign(IDCT(dense_mean))`` in place, ``dense_mean`` [B, n1*n2] fp32."""
    if not fused_supported(layout, param.device, param.dtype):
        raise ValueError(f"fused_decode_update: unsupported layout {layout} on {param.device}")
    check_tensor(param, layout, "param")
    if tuple(dense_mean.shape) != (layout.num_blocks, layout.block_numel) or dense_mean.dtype != torch.float32:
        raise ValueError(f"fused_decode_update: dense_mean must be fp32 [{layout.num_blocks}, {layout.block_numel}]")
    dense_mean = dense_mean.contiguous()
    p1, p2, f1, f2, bpr = geometry(layout, param.device)
    _decode_kernel[(layout.num_blocks,)](
        param, dense_mean, f1, f2, float(lr), layout.rows, layout.cols, bpr,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, PREC=precision, PARTIAL=layout.padded, num_warps=num_warps(p1, p2),
    )


def fused_mean_decode_update(
    param: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, lr: float, layout: BlockLayout,
    *, precision: str = "ieee",
) -> None:
    """``param -= lr * sign(IDCT(mean_of_selected(idx, vals)))`` without the dense mean.

    ``idx`` [W, B, k] (any int dtype, e.g. from ``unpack_payload``) and ``vals`` [W, B, k] fp32.
    """
    if not fused_supported(layout, param.device, param.dtype):
        raise ValueError(f"fused_mean_decode_update: unsupported layout {layout} on {param.device}")
    check_tensor(param, layout, "param")
    W, B, k = idx.shape
    if B != layout.num_blocks or tuple(vals.shape) != (W, B, k) or vals.dtype != torch.float32:
        raise ValueError("fused_mean_decode_update: idx/vals must be [W, num_blocks, k], vals fp32")
    idx, vals = idx.contiguous(), vals.contiguous()
    p1, p2, f1, f2, bpr = geometry(layout, param.device)
    plan = sparse_plan(k, p1, p2)
    _mean_decode_kernel[(B,)](
        param, idx, vals, f1, f2, float(lr), layout.rows, layout.cols, bpr, B, W,
        N1=layout.n1, N2=layout.n2, P1=p1, P2=p2, K=k, KP=plan["KP"], KC=plan["KC"], PREC=precision,
        PARTIAL=layout.padded,
        **launch_options("decode", p1, p2, device_capability(param.device)),
    )


def _mean_decode_many(outs, idx, vals, lr, layouts, precision: str, sign_update: bool, what: str,
                      scale: float = 1.0) -> None:
    device = check_group(outs, layouts, "param" if sign_update else "out")
    blk_tensor, meta, total, cols_aligned = layout_tables(layouts, device)
    if idx.dim() != 3:
        raise ValueError(f"{what}: idx/vals must be [W, total_blocks, k]")
    W, B, k = idx.shape
    if B != total or tuple(vals.shape) != (W, B, k) or vals.dtype != torch.float32:
        raise ValueError(f"{what}: idx/vals must be [W, {total}, k], vals fp32; "
                         f"got {tuple(idx.shape)} and {tuple(vals.shape)} {vals.dtype}")
    if idx.device != device or vals.device != device:
        raise ValueError(f"{what}: idx/vals on another device than the tensors")
    idx, vals = idx.contiguous(), vals.contiguous()
    ptrs, ptrs_aligned = ptr_table(tuple(p.data_ptr() for p in outs), device)
    lr_s, lr_tab = lr_arg(lr, len(outs), device)
    L0 = layouts[0]
    p1, p2 = pow2_at_least(L0.n1), pow2_at_least(L0.n2)
    f1, f2 = padded_dct(L0.n1, p1, device), padded_dct(L0.n2, p2, device)
    plan = sparse_plan(k, p1, p2)
    _mean_decode_many_kernel[(total,)](
        ptrs, blk_tensor, meta, lr_tab if lr_tab is not None else f1, idx, vals, f1, f2, lr_s, float(scale), total, W,
        N1=L0.n1, N2=L0.n2, P1=p1, P2=p2, K=k, KP=plan["KP"], KC=plan["KC"],
        LR_TABLE=lr_tab is not None, PREC=precision, ALIGNED=align_hints(cols_aligned, ptrs_aligned),
        SIGN_UPDATE=sign_update, PARTIAL=any(L.padded for L in layouts), **launch_options("decode", p1, p2, device_capability(device)),
    )


def fused_mean_decode_update_many(
    params: list[torch.Tensor],
    idx: torch.Tensor,
    vals: torch.Tensor,
    lr,
    layouts: list[BlockLayout],
    *,
    precision: str = "ieee",
    scale: float = 1.0,
) -> None:
    """:func:`fused_mean_decode_update` of many tensors with equal blocks ``n1 x n2``, in ONE launch.

    ``idx`` [W, total_blocks, k] (any int dtype; e.g. :func:`flexdemo.kernels.pack.fused_unpack_payload`
    of the group's segment) and ``vals`` [W, total_blocks, k] fp32, tensor i's blocks in rows
    ``offsets[i]:offsets[i+1]`` (:func:`flexdemo.kernels.tables.group_block_offsets`). Each
    ``params[i]`` is updated in place, bitwise as by :func:`fused_mean_decode_update` when ``scale``
    is 1. ``lr``: a float, or one per tensor. ``scale``: the parameters are first multiplied by it
    (decoupled weight decay ``1 - lr * wd``; on CUDA the multiply and the update may fuse into one
    rounding).
    """
    _mean_decode_many(params, idx, vals, lr, layouts, precision, True, "fused_mean_decode_update_many", scale)


def fused_mean_decode_many(
    outs: list[torch.Tensor], idx: torch.Tensor, vals: torch.Tensor, layouts: list[BlockLayout],
    *, precision: str = "ieee",
) -> None:
    """``outs[i] = IDCT(mean_of_selected(idx, vals))`` of tensor i, for many tensors in ONE launch
    (arguments as in :func:`fused_mean_decode_update_many`)."""
    _mean_decode_many(outs, idx, vals, 0.0, layouts, precision, False, "fused_mean_decode_many")
