import pytest
import torch

from flexdemo.wire.dct import block_layout, blocks_dct, blocks_idct, chunk_size, dct_matrix
from flexdemo.wire.format import payload_nbytes
from reference_demo import ref_chunk, ref_dct_basis


@pytest.mark.parametrize("n", [1, 2, 7, 48, 64])
def test_dct_matrix_is_orthonormal_and_matches_fft_dct(n):
    f = dct_matrix(n, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(f @ f.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    # flexdemo uses the cosine formula; the reference basis comes from an FFT.
    torch.testing.assert_close(f.T, ref_dct_basis(n), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "dim,target,expected",
    [(4096, 64, 64), (14336, 64, 64), (100, 64, 64), (48, 64, 48), (64, 64, 64), (251, 64, 64), (1, 64, 1),
     (1366, 64, 64), (1000, 7, 7)],
)
def test_block_edge_is_the_target_or_the_whole_dim(dim, target, expected):
    # A fixed edge (the last block partial), not the largest divisor: a prime dim keeps 64-wide
    # blocks instead of 1-wide ones.
    assert chunk_size(dim, target) == expected
    assert chunk_size(dim, target) == ref_chunk(dim, target)


@pytest.mark.parametrize("rows", [4096, 4000, 11008, 128256])
def test_bytes_per_tensor_do_not_depend_on_the_fsdp_degree(rows):
    # FSDP2 cuts dim 0 like torch.chunk; the block grid follows the local shard. With a fixed
    # edge and a partial last block, a shard degree adds at most one partial block row per shard.
    cols, k = 64, 32
    per_degree = {}
    for degree in (1, 2, 3, 4, 6, 8):
        shards = torch.empty(rows, cols, device="meta").chunk(degree, dim=0)
        per_degree[degree] = sum(payload_nbytes(block_layout(s.shape, 64), k, "sign") for s in shards)
    low, high = min(per_degree.values()), max(per_degree.values())
    assert high <= 1.05 * low, per_degree


@pytest.mark.parametrize("shape", [(), (1,), (7,), (130,), (128, 64), (96, 130), (5, 3, 64, 48), (2, 2, 2, 6, 10),
                                   (3, 70, 100)])
def test_round_trip_and_energy(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64)
    layout = block_layout(x.shape, 64)
    coeffs = blocks_dct(x, layout)
    assert coeffs.shape == (layout.num_blocks, layout.block_numel)
    torch.testing.assert_close(blocks_idct(coeffs, layout), x, atol=1e-12, rtol=0)
    # Orthonormal on the zero-padded blocks: the energy is kept.
    torch.testing.assert_close(coeffs.norm(), x.norm(), atol=1e-10, rtol=0)


def test_blocks_are_the_reference_blocks_in_the_reference_order():
    torch.manual_seed(1)
    x = torch.randn(192, 96, dtype=torch.float64)
    layout = block_layout(x.shape, 48)  # 48 x 48 blocks
    n1, n2 = layout.n1, layout.n2
    ours = blocks_dct(x, layout).reshape(4, 2, n1 * n2)
    for by in range(4):
        for bx in range(2):
            block = x[by * n1 : (by + 1) * n1, bx * n2 : (bx + 1) * n2]
            expected = ref_dct_basis(n1).T @ block @ ref_dct_basis(n2)
            torch.testing.assert_close(ours[by, bx], expected.reshape(-1), atol=1e-12, rtol=0)


def test_partial_blocks_are_the_zero_padded_reference_blocks():
    torch.manual_seed(4)
    x = torch.randn(100, 130, dtype=torch.float64)  # 64 x 64 blocks: 2 x 3 of them, the last row/col partial
    layout = block_layout(x.shape, 64)
    assert (layout.n1, layout.n2, layout.num_blocks) == (64, 64, 6)
    padded = torch.zeros(128, 192, dtype=torch.float64)
    padded[:100, :130] = x
    ours = blocks_dct(x, layout).reshape(2, 3, 64 * 64)
    basis = ref_dct_basis(64)
    for by in range(2):
        for bx in range(3):
            block = padded[by * 64 : (by + 1) * 64, bx * 64 : (bx + 1) * 64]
            torch.testing.assert_close(ours[by, bx], (basis.T @ block @ basis).reshape(-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", [(3, 4, 64, 32), (2, 3, 70, 20)])
def test_nd_leading_dims_are_batched_independently(shape):
    torch.manual_seed(2)
    x = torch.randn(*shape, dtype=torch.float64)
    layout = block_layout(x.shape, 64)
    whole = blocks_dct(x, layout).reshape(shape[0], shape[1], -1)
    for i in range(shape[0]):
        for j in range(shape[1]):
            sub = block_layout(x[i, j].shape, 64)
            torch.testing.assert_close(whole[i, j], blocks_dct(x[i, j], sub).reshape(-1), atol=1e-12, rtol=0)


def test_one_d_is_a_dct_per_chunk():
    torch.manual_seed(3)
    x = torch.randn(200, dtype=torch.float64)  # chunks of 64, the last 8 long (zero-padded)
    layout = block_layout(x.shape, 64)
    assert (layout.n1, layout.n2, layout.num_blocks) == (1, 64, 4)
    expected = torch.cat([x, x.new_zeros(56)]).reshape(4, 64) @ ref_dct_basis(64)
    torch.testing.assert_close(blocks_dct(x, layout), expected, atol=1e-12, rtol=0)


def test_empty_tensor_has_no_blocks():
    layout = block_layout((0, 64), 64)
    assert layout.num_blocks == 0 and layout.numel == 0


@pytest.mark.parametrize("shape", [(200,), (100, 130), (2, 70, 64)])
def test_no_transform_rows_are_the_raw_zero_padded_blocks(shape):
    # outer_transform = "none" (SparseLoCo): the same block grid, each row the block's raw values,
    # row-major; the inverse puts them back exactly and crops the padding.
    torch.manual_seed(5)
    x = torch.randn(shape)
    layout = block_layout(x.shape, 64, "none")
    rows = blocks_dct(x, layout)
    grid = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, -1)
    n1, n2 = layout.n1, layout.n2
    expected = []
    for lead in range(grid.shape[0]):
        for r0 in range(0, grid.shape[1], n1):
            for c0 in range(0, grid.shape[2], n2):
                block = torch.zeros(n1, n2)
                part = grid[lead, r0:r0 + n1, c0:c0 + n2]
                block[: part.shape[0], : part.shape[1]] = part
                expected.append(block.reshape(-1))
    assert torch.equal(rows, torch.stack(expected))
    assert torch.equal(blocks_idct(rows, layout), x)
    before = x.clone()
    rows += 1.0  # a copy, not a view: writing the rows leaves x alone
    assert torch.equal(x, before)


def test_an_unknown_transform_is_refused():
    with pytest.raises(ValueError, match="transform must be one of"):
        block_layout((4, 4), 64, "fft")
