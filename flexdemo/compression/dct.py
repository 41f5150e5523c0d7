"""Chunked orthonormal DCT-II over the last two dims of a tensor, as DeMo uses it.

Every dim of size ``s`` is cut into chunks of the largest divisor of ``s`` that is
<= ``chunk`` (``s`` itself when ``s <= chunk``), the rule of the DeMo reference. A
tensor ``[..., R, C]`` becomes ``lead * (R/n1) * (C/n2)`` blocks of ``n1 x n2``, each
transformed by the separable 2-D DCT ``Y = F1 @ X @ F2.T``. 1-D tensors are treated as
``[1, s]`` (so ``n1 == 1``: a 1-D DCT per chunk) and 0-D tensors as ``[1, 1]``.

Coefficients are returned as ``[num_blocks, n1 * n2]`` so that top-k and scatter work on
the last dim with no Python loop over blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


def chunk_size(dim: int, target: int) -> int:
    """Largest divisor of ``dim`` that is <= ``target`` (``dim`` itself if smaller)."""
    if target < 1:
        raise ValueError(f"chunk target must be >= 1, got {target}")
    if dim <= target:
        return max(dim, 1)
    for d in range(target, 0, -1):
        if dim % d == 0:
            return d
    return 1  # unreachable: 1 divides everything


@dataclass(frozen=True)
class BlockLayout:
    """How a tensor of ``shape`` is cut into DCT blocks."""

    shape: tuple[int, ...]
    lead: int  # product of the leading (batched) dims
    rows: int  # size of the second-to-last dim (1 for 0-D/1-D tensors)
    cols: int  # size of the last dim
    n1: int  # block height
    n2: int  # block width

    @property
    def block_numel(self) -> int:
        return self.n1 * self.n2

    @property
    def num_blocks(self) -> int:
        if self.numel == 0:
            return 0
        return self.lead * (self.rows // self.n1) * (self.cols // self.n2)

    @property
    def numel(self) -> int:
        return self.lead * self.rows * self.cols


def block_layout(shape: tuple[int, ...] | torch.Size, chunk: int) -> BlockLayout:
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        lead, rows, cols = 1, 1, 1
    elif len(shape) == 1:
        lead, rows, cols = 1, 1, shape[0]
    else:
        lead, rows, cols = math.prod(shape[:-2]), shape[-2], shape[-1]
    return BlockLayout(shape, lead, rows, cols, chunk_size(rows, chunk), chunk_size(cols, chunk))


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


def blocks_dct(x: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``x`` (shaped ``layout.shape``) -> coefficients ``[num_blocks, n1 * n2]``."""
    L, n1, n2 = layout, layout.n1, layout.n2
    f1 = dct_matrix(n1, x.dtype, x.device)
    f2 = dct_matrix(n2, x.dtype, x.device)
    # Last dim first: contiguous chunks of n2, one large GEMM.
    y = x.reshape(-1, n2) @ f2.T
    # Then the row dim: per row-block a (n1 x n1) @ (n1 x cols) product.
    y = torch.matmul(f1, y.reshape(L.lead * (L.rows // n1), n1, L.cols))
    # Gather each n1 x n2 block into one row for top-k.
    y = y.reshape(L.lead * (L.rows // n1), n1, L.cols // n2, n2).transpose(1, 2)
    return y.reshape(L.num_blocks, n1 * n2)


def blocks_idct(coeffs: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Inverse of :func:`blocks_dct`: ``[num_blocks, n1 * n2]`` -> tensor of ``layout.shape``."""
    L, n1, n2 = layout, layout.n1, layout.n2
    f1 = dct_matrix(n1, coeffs.dtype, coeffs.device)
    f2 = dct_matrix(n2, coeffs.dtype, coeffs.device)
    y = coeffs.reshape(L.lead * (L.rows // n1), L.cols // n2, n1, n2).transpose(1, 2)
    y = y.reshape(L.lead * (L.rows // n1), n1, L.cols)
    y = torch.matmul(f1.T, y)
    y = y.reshape(-1, n2) @ f2
    return y.reshape(layout.shape)
