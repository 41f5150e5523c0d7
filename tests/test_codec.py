import math

import pytest
import torch

from flexdemo.compression.codec import (
    compress, mean_of_selected, pack_payload, scaled_signs, select_topk, two_levels, unpack_payload,
)
from flexdemo.wire.bitpack import bits_for, pack_uint, packed_nbytes, unpack_uint
from flexdemo.wire.dct import block_layout, blocks_dct, blocks_idct
from flexdemo.wire.format import coefficients_nbytes, payload_nbytes, value_nbytes


def test_bits_for():
    assert bits_for(4096) == 12
    assert bits_for(64) == 6
    assert bits_for(65) == 7
    assert bits_for(2) == 1
    assert bits_for(1) == 0


@pytest.mark.parametrize("bits", list(range(0, 17)) + [20, 31])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1000])
def test_pack_unpack_is_lossless(bits, count):
    g = torch.Generator().manual_seed(bits * 1000 + count)
    values = torch.randint(0, 1 << bits, (count,), generator=g) if bits else torch.zeros(count, dtype=torch.int64)
    packed = pack_uint(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, bits) == math.ceil(count * bits / 8)
    assert torch.equal(unpack_uint(packed.unsqueeze(0), bits, count)[0], values)


def test_pack_extremes_and_batched_unpack():
    values = torch.tensor([0, 4095, 1, 4094, 2048, 2047])
    packed = torch.stack([pack_uint(values, 12), pack_uint(values.flip(0), 12)])
    out = unpack_uint(packed, 12, 6)
    assert torch.equal(out[0], values) and torch.equal(out[1], values.flip(0))


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "sign", "scaled_sign", "two_bit"])
@pytest.mark.parametrize("shape,topk", [((128, 64), 32), ((96, 130), 8), ((7,), 32), ((3, 64, 48), 5), ((), 4)])
def test_payload_round_trip_and_size(encoding, shape, topk):
    torch.manual_seed(0)
    x = torch.randn(shape)
    layout = block_layout(x.shape, 64)
    k = min(topk, layout.block_numel)
    idx, vals = select_topk(blocks_dct(x, layout), k)
    sent = {"scaled_sign": scaled_signs, "two_bit": two_levels}.get(encoding, lambda v: v)(vals)
    payload = pack_payload(idx, sent, layout.block_numel, encoding)
    count = layout.num_blocks * k
    counts = math.ceil(layout.num_blocks * bits_for(k + 1) / 8)  # the 1-bit encodings' voter counts
    expected = math.ceil(count * bits_for(layout.block_numel) / 8) + {
        "fp32": 4 * count, "bf16": 2 * count, "sign": math.ceil(count / 8) + counts,
        "scaled_sign": math.ceil(count / 8) + counts + 4 * layout.num_blocks,
        "two_bit": 2 * math.ceil(count / 8) + counts + 8 * layout.num_blocks}[encoding]
    assert payload.numel() == coefficients_nbytes(layout.num_blocks, k, layout.block_numel, encoding) == expected
    got_idx, got_vals = unpack_payload(payload.unsqueeze(0), layout.num_blocks, k, layout.block_numel, encoding,
                                       torch.float32)
    assert torch.equal(got_idx[0], idx)
    if encoding == "fp32":
        assert torch.equal(got_vals[0], vals)
    elif encoding == "bf16":
        assert torch.equal(got_vals[0], vals.to(torch.bfloat16).float())
    elif encoding == "scaled_sign":
        # sign of each kept value, times the mean magnitude of its block's kept values
        magnitude = vals.abs().sum(dim=1, keepdim=True) / k
        torch.testing.assert_close(got_vals[0], torch.where(vals < 0, -magnitude, magnitude), rtol=1e-6, atol=0)
    elif encoding == "two_bit":
        from reference_demo import reference_two_levels

        torch.testing.assert_close(got_vals[0], reference_two_levels(vals), rtol=1e-6, atol=0)
        assert got_vals[0].abs().unique().numel() <= 2 * layout.num_blocks  # two levels a block
    else:
        assert torch.equal(got_vals[0], torch.where(vals < 0, -1.0, 1.0))


def test_llama_block_payload_is_52_75_bytes_per_block_with_sign_values():
    layout = block_layout((4096, 4096), 64)
    # 4096 blocks x (32 x 12-bit indices + 32 sign bits + a 6-bit voter count) = 52.75 bytes each
    assert payload_nbytes(layout, 32, "sign") == 4096 * (32 * 12 + 32 + 6) // 8
    assert value_nbytes(5, 2, "bf16") == 20
    assert payload_nbytes(layout, 32, "scaled_sign") == 4096 * (32 * 12 + 32 + 6) // 8 + 4096 * 4  # + fp32 scales


@pytest.mark.parametrize("encoding", ["fp32", "bf16", "scaled_sign", "two_bit"])
def test_error_feedback_removes_exactly_what_receivers_decode(encoding):
    # For every encoding that carries magnitudes, acc_before - acc_after must be the inverse
    # DCT of what a receiver unpacks: nothing is lost and nothing is counted twice.
    torch.manual_seed(1)
    acc = torch.randn(128, 192)
    layout = block_layout(acc.shape, 64)
    before = acc.clone()
    idx, vals = compress(acc, layout, 16, encoding)
    payload = pack_payload(idx, vals, layout.block_numel, encoding)
    got_idx, got_vals = unpack_payload(payload.unsqueeze(0), layout.num_blocks, 16, layout.block_numel, encoding,
                                       torch.float32)
    received = torch.zeros(layout.num_blocks, layout.block_numel).scatter_(1, got_idx[0], got_vals[0])
    torch.testing.assert_close(before - acc, blocks_idct(received, layout), rtol=1e-5, atol=1e-6)
    assert (before - acc).abs().max() > 0.1  # something was sent


def test_topk_selects_largest_magnitudes():
    coeffs = torch.tensor([[0.1, -5.0, 3.0, -0.2], [1.0, 2.0, -3.0, 4.0]])
    idx, vals = select_topk(coeffs, 2)
    assert sorted(idx[0].tolist()) == [1, 2] and sorted(idx[1].tolist()) == [2, 3]
    assert torch.equal(vals, torch.gather(coeffs, 1, idx))


def test_mean_of_selected_matches_scatter_reduce_mean():
    torch.manual_seed(0)
    W, B, N, k = 4, 6, 64, 8
    idx = torch.stack([torch.stack([torch.randperm(N)[:k] for _ in range(B)]) for _ in range(W)])
    vals = torch.randn(W, B, k, dtype=torch.float64)
    expected = torch.zeros(B, N, dtype=torch.float64).scatter_reduce(
        1, idx.permute(1, 0, 2).reshape(B, -1), vals.permute(1, 0, 2).reshape(B, -1), "mean", include_self=False)
    torch.testing.assert_close(mean_of_selected(idx, vals, N), expected, atol=1e-14, rtol=0)
    # A coefficient chosen by every replica averages; one chosen by none stays zero.
    same = torch.zeros(W, 1, 1, dtype=torch.int64)
    assert mean_of_selected(same, torch.arange(W, dtype=torch.float64).view(W, 1, 1), 4).tolist() == [[1.5, 0, 0, 0]]
