import pytest
import torch

from flexdemo.compression.dct import block_layout, blocks_dct, blocks_idct, chunk_size, dct_matrix
from reference_demo import ref_chunk, ref_dct_basis


@pytest.mark.parametrize("n", [1, 2, 7, 48, 64])
def test_dct_matrix_is_orthonormal_and_matches_fft_dct(n):
    f = dct_matrix(n, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(f @ f.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    # flexdemo uses the cosine formula; the reference basis comes from an FFT.
    torch.testing.assert_close(f.T, ref_dct_basis(n), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "dim,target,expected",
    [(4096, 64, 64), (14336, 64, 64), (100, 64, 50), (48, 64, 48), (64, 64, 64), (251, 64, 1), (127, 64, 1),
     (97, 64, 1), (1, 64, 1), (130, 64, 26), (96, 32, 32), (1000, 7, 5)],
)
def test_chunk_rule_is_largest_divisor_not_above_target(dim, target, expected):
    assert chunk_size(dim, target) == expected
    assert chunk_size(dim, target) == ref_chunk(dim, target)


def test_chunk_rule_matches_brute_force_for_every_small_dim():
    for dim in range(1, 300):
        for target in (1, 3, 16, 64):
            assert chunk_size(dim, target) == ref_chunk(dim, target), (dim, target)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (130,), (128, 64), (96, 130), (5, 3, 64, 48), (2, 2, 2, 6, 10)])
def test_round_trip_and_energy(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    layout = block_layout(x.shape, 64)
    coeffs = blocks_dct(x, layout)
    assert coeffs.shape == (layout.num_blocks, layout.block_numel)
    torch.testing.assert_close(blocks_idct(coeffs, layout), x, atol=1e-12, rtol=0)
    torch.testing.assert_close(coeffs.norm(), x.norm(), atol=1e-10, rtol=0)  # orthonormal: energy kept


def test_blocks_are_the_reference_blocks_in_the_reference_order():
    torch.manual_seed(1)
    x = torch.randn(192, 96, dtype=torch.float64)
    layout = block_layout(x.shape, 64)  # 64 x 48 blocks
    n1, n2 = layout.n1, layout.n2
    ours = blocks_dct(x, layout).reshape(3, 2, n1 * n2)
    for by in range(3):
        for bx in range(2):
            block = x[by * n1 : (by + 1) * n1, bx * n2 : (bx + 1) * n2]
            expected = ref_dct_basis(n1).T @ block @ ref_dct_basis(n2)
            torch.testing.assert_close(ours[by, bx], expected.reshape(-1), atol=1e-12, rtol=0)


def test_nd_leading_dims_are_batched_independently():
    torch.manual_seed(2)
    x = torch.randn(3, 4, 64, 32, dtype=torch.float64)
    layout = block_layout(x.shape, 64)
    whole = blocks_dct(x, layout).reshape(3, 4, -1)
    for i in range(3):
        for j in range(4):
            sub = block_layout(x[i, j].shape, 64)
            torch.testing.assert_close(whole[i, j], blocks_dct(x[i, j], sub).reshape(-1), atol=1e-12, rtol=0)


def test_one_d_is_a_dct_per_chunk():
    torch.manual_seed(3)
    x = torch.randn(200, dtype=torch.float64)  # chunk 50
    layout = block_layout(x.shape, 64)
    assert (layout.n1, layout.n2, layout.num_blocks) == (1, 50, 4)
    expected = x.reshape(4, 50) @ ref_dct_basis(50)
    torch.testing.assert_close(blocks_dct(x, layout), expected, atol=1e-12, rtol=0)


def test_empty_tensor_has_no_blocks():
    layout = block_layout((0, 64), 64)
    assert layout.num_blocks == 0 and layout.numel == 0
