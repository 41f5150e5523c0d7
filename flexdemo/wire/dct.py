"""Chunked orthonormal DCT-II over the last two dims of a tensor, as DeMo uses it.

Every dim of size ``s`` is cut into blocks of ``min(s, chunk)``; when ``chunk`` does not
divide ``s`` the last block of that dim is partial, and the DCT sees it zero-padded to the
full edge. So the block grid, and with it the bytes sent per element, is the same however a
tensor is split: a 4096-row matrix over 3 FSDP shards has 1366-row shards and 64-row blocks
(the last one 22 rows), not the 2-row blocks that the DeMo reference's rule (the largest
divisor of the local size <= chunk) would give. A tensor ``[..., R, C]`` becomes
``lead * ceil(R/n1) * ceil(C/n2)`` blocks of ``n1 x n2``, each transformed by the separable
2-D DCT ``Y = F1 @ X @ F2.T``. 1-D tensors are treated as ``[1, s]`` (so ``n1 == 1``: a 1-D
DCT per chunk) and 0-D tensors as ``[1, 1]``.

Coefficients are returned as ``[num_blocks, n1 * n2]`` so that top-k and scatter work on
the last dim with no Python loop over blocks. The inverse crops the padding away.

A layout's ``transform`` may also be ``"none"`` (SparseLoCo's rule: the same blocks, top-k of the
raw values): then the "coefficients" are each block's elements, row-major, and no matmul runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

import torch
import torch.nn.functional as F

Transform = Literal["dct", "none"]  # what each block is top-k'd in: its DCT, or its raw values
TRANSFORMS = get_args(Transform)


def chunk_size(dim: int, target: int) -> int:
    """The block edge along a dim of size ``dim``: ``min(dim, target)`` (at least 1)."""
    if target < 1:
        raise ValueError(f"chunk target must be >= 1, got {target}")
    return max(min(dim, target), 1)


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor of ``shape`` is cut into DCT blocks (the last row/column of blocks may be partial)."""

    shape: tuple[int, ...]
    lead: int  # product of the leading (batched) dims
    rows: int  # size of the second-to-last dim (1 for 0-D/1-D tensors)
    cols: int  # size of the last dim
    n1: int  # block height
    n2: int  # block width
    chunk: int  # the target edge the blocks were cut for (a full block: chunk x chunk; 1 x chunk if 1-D)
    transform: Transform = "dct"

    @property
    def block_numel(self) -> int:
        return self.n1 * self.n2

    @property
    def row_blocks(self) -> int:
        """Blocks along the rows of one leading slice (the last may be partial)."""
        return -(-self.rows // self.n1)

    @property
    def col_blocks(self) -> int:
        return -(-self.cols // self.n2)

    @property
    def padded(self) -> bool:
        """Whether some block reaches past the tensor's edge."""
        return self.rows % self.n1 != 0 or self.cols % self.n2 != 0

    @property
    def num_blocks(self) -> int:
        if self.numel == 0:
            return 0
        return self.lead * self.row_blocks * self.col_blocks

    @property
    def numel(self) -> int:
        return self.lead * self.rows * self.cols

    def block_areas(self) -> list[int]:
        """Each block's elements inside the tensor (its valid rows x valid columns), in block order
        (leading slice, then row of blocks, then column of blocks)."""
        heights = [min(self.n1, self.rows - r * self.n1) for r in range(self.row_blocks)]
        widths = [min(self.n2, self.cols - c * self.n2) for c in range(self.col_blocks)]
        return [h * w for h in heights for w in widths] * self.lead if self.numel else []


def block_layout(shape: tuple[int, ...] | torch.Size, chunk: int, transform: Transform = "dct") -> BlockLayout:
    if transform not in TRANSFORMS:
        raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        lead, rows, cols = 1, 1, 1
    elif len(shape) == 1:
        lead, rows, cols = 1, 1, shape[0]
    else:
        lead, rows, cols = math.prod(shape[:-2]), shape[-2], shape[-1]
    return BlockLayout(shape, lead, rows, cols, chunk_size(rows, chunk), chunk_size(cols, chunk), int(chunk), transform)


@lru_cache(maxsize=None)
def _dct_matrix_cpu(n: int) -> torch.Tensor:
    # F[k, i] = s_k cos(pi (2i + 1) k / 2n), s_0 = sqrt(1/n), s_k = sqrt(2/n): orthonormal DCT-II.
    i = torch.arange(n, dtype=torch.float64)
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    f = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    f[0] = math.sqrt(1.0 / n)
    return f


_BASIS_CACHE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def dct_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``F`` (rows are frequencies): ``coeffs = F @ x``."""
    key = (n, dtype, torch.device(device))
    f = _BASIS_CACHE.get(key)
    if f is None:
        f = _dct_matrix_cpu(n).to(dtype=dtype, device=device)
        _BASIS_CACHE[key] = f
    return f


def _padded_view(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``x`` as ``[lead, row_blocks * n1, col_blocks * n2]``, zero-padded where blocks are partial."""
    L = layout
    x = x.reshape(L.lead, L.rows, L.cols)
    if L.padded:
        x = F.pad(x, (0, L.col_blocks * L.n2 - L.cols, 0, L.row_blocks * L.n1 - L.rows))
    return x


def blocks_dct(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``x`` (shaped ``layout.shape``) -> coefficients ``[num_blocks, n1 * n2]``."""
    L, n1, n2 = layout, layout.n1, layout.n2
    x = _padded_view(x, L)
    rb, cb = L.row_blocks, L.col_blocks
    if L.transform == "none":  # a copy, never a view: callers update the tensor and read the rows
        out = x.new_empty(L.num_blocks, n1 * n2)
        out.view(L.lead * rb, cb, n1, n2).copy_(x.reshape(L.lead * rb, n1, cb, n2).transpose(1, 2))
        return out
    f1 = dct_matrix(n1, x.dtype, x.device)
    f2 = dct_matrix(n2, x.dtype, x.device)
    # Last dim first: contiguous chunks of n2, one large GEMM.
    y = x.reshape(-1, n2) @ f2.T
    # Then the row dim: per row-block a (n1 x n1) @ (n1 x padded cols) product.
    y = torch.matmul(f1, y.reshape(L.lead * rb, n1, cb * n2))
    # Gather each n1 x n2 block into one row for top-k.
    y = y.reshape(L.lead * rb, n1, cb, n2).transpose(1, 2)
    return y.reshape(L.num_blocks, n1 * n2)


def blocks_idct(coeffs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Inverse of :func:`blocks_dct`: ``[num_blocks, n1 * n2]`` -> tensor of ``layout.shape``
    (what falls on the padding of partial blocks is dropped)."""
    L, n1, n2 = layout, layout.n1, layout.n2
    rb, cb = L.row_blocks, L.col_blocks
    y = coeffs.reshape(L.lead * rb, cb, n1, n2).transpose(1, 2)
    y = y.reshape(L.lead * rb, n1, cb * n2)
    if L.transform == "dct":
        y = torch.matmul(dct_matrix(n1, coeffs.dtype, coeffs.device).T, y)
        y = y.reshape(-1, n2) @ dct_matrix(n2, coeffs.dtype, coeffs.device)
    if L.padded:
        y = y.reshape(L.lead, rb * n1, cb * n2)[:, : L.rows, : L.cols]
    return y.reshape(layout.shape)
