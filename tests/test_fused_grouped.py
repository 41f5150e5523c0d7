"""Grouped (multi-tensor, one launch per group) fused codec vs the per-tensor fused kernels.

Grouped results must be bitwise those of calling the per-tensor functions on each tensor.
Like tests/test_fused_codec.py this needs TRITON_INTERPRET=1 for the whole run:

    TRITON_INTERPRET=1 python3 -m pytest tests/test_fused_grouped.py -q
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import kernels_or_skip

from flexdemo.wire.dct import block_layout

fc = kernels_or_skip()

LR, DECAY = 1e-3, 0.9

# (shapes, chunk, k): every group shares its n1 x n2 blocks but not its shapes.
GROUPS = {
    "64x64": ([(128, 128), (64, 64), (2, 64, 64), (64, 128)], 64, 32),
    "32x32": ([(64, 32), (32, 96), (2, 32, 64)], 32, 5),
    # partial blocks at the tensors' edges (zero-padded for the DCT, never stored), 3-D included
    "partial": ([(96, 64), (100, 130), (2, 70, 64)], 64, 7),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    # A contiguous copy whose data_ptr is 4 bytes past a 16-byte boundary (a slice of a flat buffer):
    # the grouped kernels must then drop their alignment hints.
    buf = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.is_contiguous()
    return out


def _group(name, seed, no_grad=()):
    shapes, chunk, k = GROUPS[name]
    layouts = [block_layout(s, chunk) for s in shapes]
    assert len({fc.group_key(L, k, "sign") for L in layouts}) == 1
    g = torch.Generator().manual_seed(seed)
    deltas = [torch.randn(s, generator=g) for s in shapes]
    if name == "32x32":
        deltas[1] = _misaligned(deltas[1])
    grads = [None if i in no_grad else torch.randn(s, generator=g) for i, s in enumerate(shapes)]
    return layouts, k, deltas, grads


def _encode_both(layouts, k, deltas, grads, encoding, lr=LR, steps=1):
    """Per-tensor and grouped encode from the same start, `steps` times; returns both results."""
    lrs = lr if isinstance(lr, list) else [lr] * len(deltas)
    d_ref = [d.clone() for d in deltas]
    d_grp = [_misaligned(d) if d.data_ptr() % 16 else d.clone() for d in deltas]
    for _ in range(steps):
        ref = [fc.fused_encode(d, g, lr_i, DECAY, L, k, encoding) for d, g, lr_i, L in zip(d_ref, grads, lrs, layouts)]
        idx, vals = fc.fused_encode_many(d_grp, grads, lr, DECAY, layouts, k, encoding)
    return d_ref, ref, d_grp, idx, vals


def _assert_encode_equal(layouts, deltas, d_ref, ref, d_grp, idx, vals):
    offs = fc.group_block_offsets(layouts)
    assert idx.shape == (offs[-1], ref[0][0].shape[1]) and idx.dtype == torch.int32
    assert vals.shape == idx.shape and vals.dtype == torch.float32
    for i, ((r_idx, r_vals), d0, dr, dg) in enumerate(zip(ref, deltas, d_ref, d_grp)):
        assert _same_bits(idx[offs[i]:offs[i + 1]], r_idx), f"tensor {i}: idx differ"
        assert _same_bits(vals[offs[i]:offs[i + 1]], r_vals), f"tensor {i}: vals differ"
        assert _same_bits(dg, dr), f"tensor {i}: delta differs"
        assert not torch.equal(dg, d0), f"tensor {i}: delta not updated"


@pytest.mark.parametrize("name,encoding", [("64x64", "sign"), ("64x64", "bf16"), ("32x32", "fp32"), ("partial", "sign"),
                                           ("64x64", "scaled_sign")])
def test_encode_many_matches_per_tensor(name, encoding):
    layouts, k, deltas, grads = _group(name, seed=1)
    d_ref, ref, d_grp, idx, vals = _encode_both(layouts, k, deltas, grads, encoding)
    _assert_encode_equal(layouts, deltas, d_ref, ref, d_grp, idx, vals)


def test_encode_many_mixed_grads_per_tensor_lr_and_cached_tables():
    # Tensor 1 has no grad (zero), lrs differ per tensor; two steps (2nd hits the table caches).
    layouts, k, deltas, grads = _group("64x64", seed=2, no_grad=(1,))
    lrs = [1e-3, 2e-3, 5e-4, 3e-3]
    d_ref, ref, d_grp, idx, vals = _encode_both(layouts, k, deltas, grads, "sign", lr=lrs, steps=2)
    _assert_encode_equal(layouts, deltas, d_ref, ref, d_grp, idx, vals)
    # All grads None in one group.
    layouts, k, deltas, grads = _group("32x32", seed=2)
    d_ref, ref, d_grp, idx, vals = _encode_both(layouts, k, deltas, [None] * len(deltas), "bf16")
    _assert_encode_equal(layouts, deltas, d_ref, ref, d_grp, idx, vals)


def test_a_skip_flag_on_the_device_drops_every_grad():
    # skip_grad (DeMo's non-finite flag, read by the kernel): 1 encodes as if every grad were
    # None, even NaN ones; 0 as if there were no flag. Grouped (mixed grads) and per-tensor.
    layouts, k, deltas, grads = _group("64x64", seed=3, no_grad=(2,))
    grads[1] = grads[1].clone()
    grads[1][5, 7] = float("nan")
    for skip, want_grads in ((1.0, [None] * len(grads)), (0.0, grads)):
        flag = torch.tensor([skip])
        d_want, d_grp = [d.clone() for d in deltas], [d.clone() for d in deltas]
        want = fc.fused_encode_many(d_want, want_grads, LR, DECAY, layouts, k, "sign")
        got = fc.fused_encode_many(d_grp, grads, LR, DECAY, layouts, k, "sign", skip_grad=flag)
        # skip: values (+0 and -0 compare equal: 0 * lr was added); no skip: bits (NaN included)
        same = torch.equal if skip else _same_bits
        assert all(same(a, b) for a, b in zip(want, got)), skip
        assert all(same(a, b) for a, b in zip(d_want, d_grp)), skip
        assert torch.isnan(d_grp[1]).any() != bool(skip)
        d_one = deltas[1].clone()
        one = fc.fused_encode(d_one, grads[1], LR, DECAY, layouts[1], k, "sign", skip_grad=flag)
        offs = fc.group_block_offsets(layouts)
        assert _same_bits(one[0], got[0][offs[1]:offs[2]]) and _same_bits(d_one, d_grp[1]), skip
    with pytest.raises(ValueError, match="skip_grad must be one fp32 element"):
        fc.fused_encode_many(deltas, grads, LR, DECAY, layouts, k, "sign", skip_grad=torch.tensor([1, 0.0]))


def _replicas(idx, vals, W, seed):
    # Replica 0 is ours; the others are block-rolled copies (distinct per-block indices, partial
    # overlap with ours) with scaled values.
    g = torch.Generator().manual_seed(seed)
    out_i = [idx] + [idx.roll(w, 0) for w in range(1, W)]
    out_v = [vals] + [vals.roll(w, 0) * torch.randn(1, generator=g).item() for w in range(1, W)]
    return torch.stack(out_i), torch.stack(out_v)


@pytest.mark.parametrize("name", ["64x64", "32x32", "partial"])
@pytest.mark.parametrize("W", [1, 3])
def test_mean_decode_many_matches_per_tensor(name, W):
    layouts, k, deltas, grads = _group(name, seed=3)
    idx, vals = fc.fused_encode_many([d.clone() for d in deltas], grads, LR, DECAY, layouts, k, "fp32")
    g_idx, g_vals = _replicas(idx, vals, W, seed=4)
    offs = fc.group_block_offsets(layouts)
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(L.shape, generator=g) for L in layouts]
    p_ref = [p.clone() for p in params]
    for i, (p, L) in enumerate(zip(p_ref, layouts)):
        fc.fused_mean_decode_update(p, g_idx[:, offs[i]:offs[i + 1]], g_vals[:, offs[i]:offs[i + 1]], 1e-2, L)
    p_grp = [p.clone() for p in params]
    if name == "32x32":
        p_grp[2] = _misaligned(p_grp[2])
    fc.fused_mean_decode_update_many(p_grp, g_idx, g_vals, 1e-2, layouts)
    for i, (p0, pr, pg) in enumerate(zip(params, p_ref, p_grp)):
        assert _same_bits(pg, pr), f"tensor {i}: params differ"
        assert (pg != p0).float().mean() > 0.9, f"tensor {i}: params not updated"
    # The dense (outer-step) decode: one launch writes every tensor, bitwise as one tensor at a time.
    outs_grp = [torch.empty(L.shape) for L in layouts]
    fc.fused_mean_decode_many(outs_grp, g_idx, g_vals, layouts)
    for i, (o, L) in enumerate(zip(outs_grp, layouts)):
        one = torch.empty(L.shape)
        fc.fused_mean_decode_many([one], g_idx[:, offs[i]:offs[i + 1]].contiguous(),
                                  g_vals[:, offs[i]:offs[i + 1]].contiguous(), [L])
        assert _same_bits(o, one), f"tensor {i}: dense decode differs"
    if W != 1:
        return
    # Per-tensor learning rates.
    lrs = [1e-2 * (i + 1) for i in range(len(layouts))]
    p_ref = [p.clone() for p in params]
    for i, (p, L) in enumerate(zip(p_ref, layouts)):
        fc.fused_mean_decode_update(p, g_idx[:, offs[i]:offs[i + 1]], g_vals[:, offs[i]:offs[i + 1]], lrs[i], L)
    p_grp = [p.clone() for p in params]
    fc.fused_mean_decode_update_many(p_grp, g_idx, g_vals, lrs, layouts)
    assert all(_same_bits(pg, pr) for pr, pg in zip(p_ref, p_grp))


@pytest.mark.parametrize("name,encoding", [("64x64", "sign"), ("32x32", "bf16"), ("partial", "scaled_sign")])
def test_group_pipeline_one_pack_one_unpack(name, encoding):
    # encode_many -> ONE pack of the group -> gather (W rows) -> ONE unpack -> mean_decode_many,
    # against the per-tensor fused pipeline.
    layouts, k, deltas, grads = _group(name, seed=6)
    bn = layouts[0].block_numel
    offs = fc.group_block_offsets(layouts)
    idx, vals = fc.fused_encode_many([d.clone() for d in deltas], grads, LR, DECAY, layouts, k, encoding)
    payload = fc.fused_pack_payload(idx, vals, bn, encoding)
    other = fc.fused_pack_payload(idx.roll(1, 0), -vals.roll(1, 0), bn, encoding)
    u_idx, u_vals = fc.fused_unpack_payload(torch.stack([payload, other]), offs[-1], k, bn, encoding)

    g = torch.Generator().manual_seed(7)
    params = [torch.randn(L.shape, generator=g) for L in layouts]
    p_grp = [p.clone() for p in params]
    fc.fused_mean_decode_update_many(p_grp, u_idx, u_vals, 1e-2, layouts)
    for i, (p0, pg, L) in enumerate(zip(params, p_grp, layouts)):
        sl = slice(offs[i], offs[i + 1])
        pay_i = torch.stack([fc.fused_pack_payload(idx[sl], vals[sl], bn, encoding),
                             fc.fused_pack_payload(idx.roll(1, 0)[sl], -vals.roll(1, 0)[sl], bn, encoding)])
        r_idx, r_vals = fc.fused_unpack_payload(pay_i, L.num_blocks, k, bn, encoding)
        assert torch.equal(r_idx, u_idx[:, sl]) and _same_bits(r_vals, u_vals[:, sl])
        pr = p0.clone()
        fc.fused_mean_decode_update(pr, r_idx, r_vals, 1e-2, L)
        assert _same_bits(pg, pr), f"tensor {i}: params differ"


def test_group_errors():
    L64, L32 = block_layout((64, 64), 64), block_layout((64, 64), 32)
    assert fc.group_key(L64, 32, "sign") != fc.group_key(L32, 32, "sign")
    d = [torch.zeros(64, 64), torch.zeros(64, 64)]
    with pytest.raises(ValueError, match="group"):
        fc.fused_encode_many(d, [None, None], LR, DECAY, [L64, L32], 4, "sign")
    with pytest.raises(ValueError):
        fc.fused_encode_many(d, [None, None], [LR], DECAY, [L64, L64], 4, "sign")  # 1 lr for 2 tensors
    with pytest.raises(ValueError):
        fc.fused_encode_many([d[0].t(), d[1]], [None, None], LR, DECAY, [L64, L64], 4, "sign")
    idx = torch.zeros(1, 1, 4, dtype=torch.int32)  # 1 block, the group has 2
    with pytest.raises(ValueError):
        fc.fused_mean_decode_update_many(d, idx, torch.zeros(1, 1, 4), LR, [L64, L64])
