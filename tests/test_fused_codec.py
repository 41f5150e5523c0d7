"""Fused Triton codec vs the torch path, on CPU through the Triton interpreter.

Needs TRITON_INTERPRET=1 in the environment of the whole run (Triton consults it both when
kernels are decorated and when they launch), so it is not set here, which would leak into
every later test of the session; without it the module skips:

    TRITON_INTERPRET=1 python3 -m pytest tests/test_fused_codec.py -q
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import kernels_or_skip

from flexdemo.compression.codec import compress, mean_of_selected, pack_payload, scaled_signs, unpack_payload
from flexdemo.wire.dct import block_layout, blocks_idct

fc = kernels_or_skip()

import triton  # noqa: E402  (after the guard: the interpreter must be on)
import triton.language as tl  # noqa: E402

from flexdemo.kernels.common import topk_threshold  # noqa: E402

DEV = torch.device("cpu")
LR, DECAY = 1e-3, 0.9

# (shape, chunk, k): 64x64 blocks, 32x32, a 3-D tensor (lead > 1), 48-row blocks (padded),
# and 16x16 blocks with k at its extremes.
CASES = [
    ((128, 192), 64, 32),
    ((128, 192), 64, 1),
    ((64, 32), 32, 5),
    ((2, 32, 64), 32, 32),
    ((96, 64), 64, 5),
    ((32, 48), 16, 256),
    ((2048,), 64, 32),  # 1-D (a norm weight): 1 x 64 blocks
    ((300,), 64, 5),  # 1-D, 1 x 64 blocks, the last one partial
    ((100, 130), 64, 32),  # partial blocks at the bottom and right edges (zero-padded for the DCT)
    ((3, 70, 40), 32, 8),  # 3-D: each leading slice ends in a partial row of blocks
]


# The mean decode densifies 32 kept coefficients at a time: k above 32 spans several chunks
# (200: a partial last one).
DECODE_CASES = [*CASES[:5], *CASES[-2:], ((128, 192), 64, 200), ((64, 128), 64, 256)]


def _torch_encode(delta, grad, layout, k, encoding):
    d = delta.clone().mul_(DECAY)
    if grad is not None:
        d.add_(grad, alpha=LR)
    idx, vals = compress(d, layout, k, encoding)
    return d, idx, vals


def _data(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # Continuous random data: no ties in |coefficient| (torch.topk's tie order is unspecified).
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("shape,chunk,k", CASES)
@pytest.mark.parametrize("encoding", ["sign", "bf16", "fp32", "scaled_sign"])
def test_encode_matches_torch(shape, chunk, k, encoding):
    if encoding not in ("sign", "scaled_sign") and shape != CASES[0][0]:
        pytest.skip("value encodings only change error feedback: one shape is enough")
    layout = block_layout(shape, chunk)
    assert fc.fused_supported(layout, DEV)
    delta, grad = _data(shape, 1)
    ref_d, ref_idx, ref_vals = _torch_encode(delta, grad, layout, k, encoding)

    d = delta.clone()
    idx, vals = fc.fused_encode(d, grad, LR, DECAY, layout, k, encoding)
    assert idx.shape == (layout.num_blocks, k) and vals.shape == (layout.num_blocks, k)

    ref_sorted, order = ref_idx.sort(1)
    # Index sets match exactly per block (fused emits them in ascending order).
    assert torch.equal(idx.long(), ref_sorted)
    scale = ref_vals.abs().max()
    torch.testing.assert_close(vals, ref_vals.gather(1, order), rtol=0, atol=1e-5 * scale)
    # Relative to delta before error feedback (with k == n1*n2 nearly all of it is removed).
    torch.testing.assert_close(d, ref_d, rtol=0, atol=1e-5 * (delta * DECAY + grad * LR).abs().max())
    # The payload packs the same bytes as the torch path's (same order after sorting).
    assert torch.equal(
        pack_payload(idx, vals, layout.block_numel, "sign"),
        pack_payload(ref_sorted, ref_vals.gather(1, order), layout.block_numel, "sign"),
    )


def test_encode_without_grad_and_bf16_error_feedback_differs():
    shape, layout, k = (64, 64), block_layout((64, 64), 64), 32
    delta, _ = _data(shape, 2)
    ref_d, ref_idx, _ = _torch_encode(delta, None, layout, k, "bf16")
    d = delta.clone()
    idx, _ = fc.fused_encode(d, None, LR, DECAY, layout, k, "bf16")
    assert torch.equal(idx.long(), ref_idx.sort(1).values)
    torch.testing.assert_close(d, ref_d, rtol=0, atol=1e-5 * ref_d.abs().max())
    # bf16 rounding must stay in delta: fp32 error feedback gives a measurably different delta.
    d32 = delta.clone()
    fc.fused_encode(d32, None, LR, DECAY, layout, k, "fp32")
    assert (d32 - d).abs().max() > 1e-4 * ref_d.abs().max()


def test_kept_zeros_come_after_the_voters_and_cast_no_vote():
    # Exact zeros made exactly, not by cancellation (which a kernel's FMA or tf32x3 products
    # need not reproduce): an all-zero block (zero input: every coefficient is exactly 0) keeps
    # k zeros in the encode, and hand-made kept slots with zeros between the voters test the
    # pack. Which of several equal zeros a top-k keeps is unspecified and not asserted.
    layout = block_layout((8, 2), 4)
    g = torch.Generator().manual_seed(3)
    d = torch.cat([torch.randn(4, 2, generator=g), torch.zeros(4, 2)])  # block 1 all zero
    for encoding in ("sign", "scaled_sign", "fp32", "bf16"):
        ref_d, ref_idx, ref_vals = _torch_encode(d, None, layout, 6, encoding)
        got_d = d.clone()
        idx, vals = fc.fused_encode(got_d, None, LR, DECAY, layout, 6, encoding)
        assert torch.all(vals[1] == 0) and torch.all(ref_vals[1] == 0), encoding  # zeros kept, no value
        assert torch.all(vals[0] != 0), encoding  # continuous data: six voters in block 0
        assert torch.equal(idx[0].long(), ref_idx[0].sort().values), encoding
        torch.testing.assert_close(got_d, ref_d, rtol=0, atol=1e-6)
        assert torch.all(got_d[4:] == 0), encoding  # nothing was taken out of the zero block
    # The pack sends each block's voters first, then its zeros; unpacked, the zeros read as
    # index -1 / value 0 (no vote), on both paths, in every encoding.
    idx = torch.tensor([[0, 1, 2, 3, 4, 6], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    raw = torch.tensor([[0.5, 0.0, -2.0, -0.0, 3.0, 1.5], [0.0] * 6])
    for encoding in ("sign", "scaled_sign", "fp32", "bf16"):
        vals = scaled_signs(raw) if encoding == "scaled_sign" else raw
        v_idx, v_vals = fc.fused_voters_first(idx, vals)  # what the pack sends: voters first
        assert v_idx[0].tolist() == [0, 2, 4, 6, 1, 3] and torch.equal(v_vals[0, :4], vals[0, [0, 2, 4, 5]]), encoding
        payload = fc.fused_pack_payload(idx, vals, 8, encoding)
        # The torch path's payload decodes to the same votes.
        r_idx, r_vals = unpack_payload(pack_payload(idx.long(), vals, 8, encoding).unsqueeze(0), 2, 6, 8, encoding,
                                       torch.float32)
        assert sorted(r_idx[0, 0].tolist()) == [-1, -1, 0, 2, 4, 6] and r_idx[0, 1].tolist() == [-1] * 6, encoding
        u_idx, u_vals = fc.fused_unpack_payload(payload.unsqueeze(0), 2, 6, 8, encoding)
        t_idx, t_vals = unpack_payload(payload.unsqueeze(0), 2, 6, 8, encoding, torch.float32)
        assert torch.equal(u_idx, t_idx.to(torch.int32)), encoding
        assert sorted(u_idx[0, 0].tolist()) == [-1, -1, 0, 2, 4, 6] and u_idx[0, 1].tolist() == [-1] * 6, encoding
        assert torch.equal(u_vals, t_vals) and torch.equal(u_vals == 0, u_idx == -1), encoding
        assert torch.equal(mean_of_selected(u_idx.long(), u_vals, 8), mean_of_selected(r_idx, r_vals, 8)), encoding


def test_ties_take_lowest_indices():
    # An all-zero block: every |coefficient| ties at 0, so the first k indices are chosen.
    layout = block_layout((32, 32), 32)
    d = torch.zeros(32, 32)
    idx, vals = fc.fused_encode(d, None, LR, DECAY, layout, 7, "sign")
    assert idx.tolist() == [list(range(7))]
    assert torch.all(vals == 0) and torch.all(d == 0)


def _replicas(layout, k, W, seed, first_idx=None):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([
        torch.stack([torch.randperm(layout.block_numel, generator=g)[:k] for _ in range(layout.num_blocks)])
        for _ in range(W)
    ])
    if first_idx is not None:
        idx[0] = first_idx
    # Overlap between replicas: replica 1 repeats half of replica 0's picks.
    if W > 1:
        idx[1, :, : k // 2] = idx[0, :, : k // 2]
        for b in range(layout.num_blocks):  # keep each replica's indices distinct per block
            rest = [i for i in torch.randperm(layout.block_numel, generator=g).tolist()
                    if i not in set(idx[1, b, : k // 2].tolist())]
            idx[1, b, k // 2 :] = torch.tensor(rest[: k - k // 2])
    vals = torch.randn(W, layout.num_blocks, k, generator=g)
    return idx, vals


def _check_params(got, ref, direction):
    bad = got != ref
    near_zero = direction.abs() <= 1e-5 * direction.abs().max()
    assert not (bad & ~near_zero).any(), f"{int((bad & ~near_zero).sum())} params differ away from zero"


@pytest.mark.parametrize("shape,chunk,k", DECODE_CASES)
@pytest.mark.parametrize("W", [1, 3])
def test_decode_matches_torch(shape, chunk, k, W):
    layout = block_layout(shape, chunk)
    idx, vals = _replicas(layout, k, W, seed=3)
    param, _ = _data(shape, 4)
    dense = mean_of_selected(idx, vals, layout.block_numel)
    direction = blocks_idct(dense, layout)
    ref = param.add(direction.sign(), alpha=-1e-2)

    p = param.clone()
    fc.fused_decode_update(p, dense, 1e-2, layout)
    _check_params(p, ref, direction)
    assert (p != param).float().mean() > 0.9  # it did update

    p = param.clone()
    fc.fused_mean_decode_update(p, idx, vals, 1e-2, layout)
    _check_params(p, ref, direction)


@pytest.mark.parametrize("shape,chunk,k", DECODE_CASES)
def test_dense_decode_matches_torch(shape, chunk, k):
    # The outer step's decode: IDCT(mean over selecting replicas) written out, no sign.
    layout = block_layout(shape, chunk)
    idx, vals = _replicas(layout, k, 3, seed=8)
    ref = blocks_idct(mean_of_selected(idx, vals, layout.block_numel), layout)
    out = torch.full(shape, float("nan"))
    fc.fused_mean_decode_many([out], idx, vals, [layout])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * ref.abs().max())


def test_mean_decode_from_payloads_sign():
    # Full path: fused encode -> pack -> unpack (W copies with different signs) -> fused mean+decode.
    shape, layout, k = (64, 128), block_layout((64, 128), 64), 32
    delta, grad = _data(shape, 5)
    idx, vals = fc.fused_encode(delta.clone(), grad, LR, DECAY, layout, k, "sign")
    payload = pack_payload(idx, vals, layout.block_numel, "sign")
    gathered = torch.stack([payload, pack_payload(idx, -vals, layout.block_numel, "sign"), payload])
    u_idx, u_vals = unpack_payload(gathered, layout.num_blocks, k, layout.block_numel, "sign", torch.float32)
    dense = mean_of_selected(u_idx, u_vals, layout.block_numel)
    direction = blocks_idct(dense, layout)
    param, _ = _data(shape, 6)
    ref = param.add(direction.sign(), alpha=-1e-2)
    p = param.clone()
    fc.fused_mean_decode_update(p, u_idx, u_vals, 1e-2, layout)
    _check_params(p, ref, direction)


def test_supported_layouts():
    assert fc.fused_supported(block_layout((512, 4096), 64), DEV)
    assert fc.fused_supported(block_layout((16032, 4096), 64), DEV)  # 48-row blocks, padded
    assert fc.fused_supported(block_layout((4096,), 64), DEV)  # 1-D: one row of 1 x 64 blocks
    assert not fc.fused_supported(block_layout((), 64), DEV)  # 0-D: torch path
    assert not fc.fused_supported(block_layout((256, 256), 128), DEV)  # blocks > 64
    assert not fc.fused_supported(block_layout((64, 64), 64), DEV, torch.bfloat16)
    assert not fc.fused_supported(block_layout((64, 64), 64, "none"), DEV)  # no DCT: the kernels are DCT kernels
    # In-block offsets are int32: a block's (padded) rows times the row length must stay below
    # 2**31 (no tensor this large is allocated; the layout is only shapes).
    assert fc.fused_supported(block_layout((64, 2**25 - 64), 64), DEV)
    assert not fc.fused_supported(block_layout((64, 2**25), 64), DEV)
    assert not fc.fused_supported(block_layout((2**27,), 64), DEV)  # 1-D: 16 padded rows x 2**27
    with pytest.raises(ValueError):
        fc.fused_encode(torch.zeros(64, 64).t(), None, LR, DECAY, block_layout((64, 64), 64), 4, "sign")


@pytest.mark.parametrize("encoding", ["sign", "bf16", "fp32", "scaled_sign"])
@pytest.mark.parametrize("block_numel,B,k", [(4096, 3, 32), (1024, 2, 5), (64, 5, 7), (2, 3, 1)])
def test_pack_unpack_match_torch(encoding, block_numel, B, k):
    g = torch.Generator().manual_seed(7)
    idx = torch.stack([torch.randperm(block_numel, generator=g)[:k] for _ in range(B)]).to(torch.int32)
    vals = torch.randn(B, k, generator=g)
    # Zeros cast no vote; the encoders emit each block's voters first: a -0.0 (signbit set)
    # last in block 0, an all-zero block 1, block 2 half zeros.
    vals[0, -1] = -0.0
    vals[1] = 0.0
    if B > 2:
        vals[2, k // 2 + 1:] = 0.0
    if encoding == "scaled_sign":  # what the encoder emits: +-(mean |kept non-zero|) per block
        vals = scaled_signs(vals)
    ref = pack_payload(idx, vals, block_numel, encoding)
    got = fc.fused_pack_payload(idx, vals, block_numel, encoding)
    assert torch.equal(got, ref)
    out = torch.full_like(ref, 0xAA)
    assert fc.fused_pack_payload(idx, vals, block_numel, encoding, out=out) is out and torch.equal(out, ref)

    # Unpack from a column slice of a wider gathered buffer (row stride != row length).
    other = pack_payload(idx.flip(1), -vals, block_numel, encoding)
    wide = torch.stack([torch.cat([torch.zeros(3, dtype=torch.uint8), p, torch.ones(2, dtype=torch.uint8)])
                        for p in (ref, other)])
    payload = wide[:, 3 : 3 + ref.numel()]
    ref_idx, ref_vals = unpack_payload(payload, B, k, block_numel, encoding, torch.float32)
    got_idx, got_vals = fc.fused_unpack_payload(payload, B, k, block_numel, encoding)
    assert got_idx.dtype == torch.int32 and torch.equal(got_idx.long(), ref_idx)
    assert torch.equal(got_vals, ref_vals)


@pytest.mark.parametrize("encoding", ["sign", "scaled_sign", "fp32", "bf16"])
def test_fused_pack_and_unpack_give_the_golden_bytes(encoding):
    from test_wire_format import DECODED_IDX, DECODED_VALS, GOLDEN, IDX, sent

    got = fc.fused_pack_payload(IDX.to(torch.int32), sent(encoding), 16, encoding)
    assert got.tolist() == GOLDEN[encoding]
    idx, vals = fc.fused_unpack_payload(torch.tensor(GOLDEN[encoding], dtype=torch.uint8).unsqueeze(0), 2, 2, 16,
                                        encoding)
    assert idx[0].tolist() == DECODED_IDX and vals[0].tolist() == DECODED_VALS[encoding]


@triton.jit
def _threshold_kernel(bits_ptr, out_ptr, K: tl.constexpr, TOTAL: tl.constexpr, P: tl.constexpr,
                      BRACKET: tl.constexpr):
    r = tl.arange(0, P)
    bits = tl.load(bits_ptr + r[:, None] * P + r[None, :])
    thr, cnt = topk_threshold(bits, K, TOTAL, BRACKET)
    tl.store(out_ptr, thr)
    tl.store(out_ptr + 1, cnt)


@pytest.mark.parametrize("k", [1, 7, 12, 32, 200, 256])
@pytest.mark.parametrize("spread", ["ties", "wide", "padded", "padded_rows", "flat_rows"])
@pytest.mark.parametrize("bracket", [False, True])
def test_topk_threshold_is_the_kth_largest(k, spread, bracket):
    # The bit search alone, on int32 tiles with many ties, full-range values, -1 padding (columns
    # or rows) and rows whose maxima are all equal, against sorting: either exactly k values are
    # >= thr and they are the top k, or thr is the k-th largest value itself (ties at it). The
    # bracket start is valid for k <= the valid rows only (the kernels' caller checks it).
    g = torch.Generator().manual_seed(k)
    rows = 12 if spread == "padded_rows" else 16
    if bracket and k > rows:
        pytest.skip("the bracket needs k <= rows")
    for trial in range(4):
        if spread == "ties":
            bits = torch.randint(0, 6, (16, 16), generator=g, dtype=torch.int32) << (7 * trial)
        else:
            bits = torch.randint(0, 2**31 - 1, (16, 16), generator=g, dtype=torch.int32) >> (8 * trial)
        if spread == "flat_rows":  # every row's maximum the same value: an empty bracket
            bits = bits.clamp(max=int(bits.amax(1).min()))
        total = 256
        if spread == "padded":
            bits[:, 12:] = -1
            total = 16 * 12
        if spread == "padded_rows":
            bits[12:, :] = -1
            total = 12 * 16
        if k > total:
            continue
        out = torch.zeros(2, dtype=torch.int32)
        _threshold_kernel[(1,)](bits, out, K=k, TOTAL=total, P=16, BRACKET=bracket)
        thr, cnt = out.tolist()
        ranked = bits.flatten().sort(descending=True).values
        kth = int(ranked[k - 1])
        assert cnt == int((bits >= thr).sum()) >= k
        if k == total or kth > int(ranked[k]):
            assert cnt == k and torch.equal(bits >= thr, bits >= kth)
        else:
            assert thr == kth


def _encodes_under(name, settings, delta, grad, layout, k):
    """(delta after, idx, vals) of one sign encode per setting of fused_encode's keyword name."""
    outs = []
    for setting in settings:
        d = delta.clone()
        idx, vals = fc.fused_encode(d, grad, LR, DECAY, layout, k, "sign", **{name: setting})
        outs.append((d, idx, vals))
    return outs


def test_encode_with_the_bracket_search_is_bitwise_the_same():
    # The bracket (the default where k <= n1; bracket=False: from the top bit) changes where the
    # search starts, not what it selects: every output bitwise equal, on random blocks, an
    # all-zero block (every coefficient ties) and 48-row blocks. So it is no config key.
    from flexdemo.kernels.common import search_bracket

    for shape, chunk, k in [((128, 192), 64, 32), ((96, 64), 64, 5), ((64, 32), 32, 32)]:
        layout = block_layout(shape, chunk)
        assert search_bracket(k, layout.n1)  # the library's choice here is the bracket
        delta, grad = _data(shape, 7)
        delta[:chunk, :chunk] = 0.0
        grad[:chunk, :chunk] = 0.0
        outs = _encodes_under("bracket", (False, True, None), delta, grad, layout, k)
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*outs))
    assert not search_bracket(65, 64)  # k > n1: from the top bit
    layout = block_layout((16, 64), 8)
    with pytest.raises(ValueError, match="bracket"):
        fc.fused_encode(*_data((16, 64), 1), LR, DECAY, layout, 9, "sign", bracket=True)


def test_a_register_ceiling_launches_and_changes_nothing():
    # A register ceiling (maxnreg: timing and profiling) only changes a launch option; a bad value
    # is refused with one message naming it. (Its effect on the compiled kernel:
    # test_kernel_sass_profile.py.) So it is no config key.
    shape, chunk, k = (128, 192), 64, 32
    layout = block_layout(shape, chunk)
    delta, grad = _data(shape, 11)
    outs = _encodes_under("maxnreg", (0, 128, None), delta, grad, layout, k)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(*outs))
    for bad in (12, 300, "lots", -1, True):
        with pytest.raises(ValueError, match="maxnreg"):
            fc.fused_encode(delta.clone(), grad, LR, DECAY, layout, k, "sign", maxnreg=bad)


def test_launch_options_cap_registers_on_hopper_only():
    from flexdemo.kernels.common import HOPPER_MAXNREG, launch_options

    assert launch_options("encode", 64, 64, (9, 0)) == {"num_warps": 4, "maxnreg": HOPPER_MAXNREG["encode"]}
    assert launch_options("encode", 64, 64, (8, 0)) == {"num_warps": 4}  # not measured elsewhere
    assert launch_options("encode", 64, 64, None) == {"num_warps": 4}
    assert launch_options("encode", 1, 64, (9, 0))["num_warps"] == 2
    assert launch_options("encode", 32, 64, None)["num_warps"] == 4  # 2048 padded elements
    assert launch_options("encode", 32, 32, None)["num_warps"] == 2
    assert launch_options("decode", 64, 64, (9, 0))["maxnreg"] == HOPPER_MAXNREG["decode"]
    assert launch_options("encode", 64, 64, (9, 0), maxnreg=0) == {"num_warps": 4}
    assert launch_options("decode", 64, 64, None, maxnreg=128) == {"num_warps": 4, "maxnreg": 128}
    assert "maxnreg" not in launch_options("encode", 64, 64, None)
