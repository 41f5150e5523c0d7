"""A bucket's encode / decode through the fused Triton kernels (GPU fast path).

Uses the multi-tensor kernels (one launch per bucket) when flexdemo.fused_codec has them,
else one launch per tensor; either way the results are those of the per-tensor kernels.
"""

from __future__ import annotations

import torch

from flexdemo import fused_codec as fc
from flexdemo.dct import BlockLayout


def fused_encode_bucket(deltas, grads, lr: float, decay: float, layouts: list[BlockLayout], k: int, encoding: str):
    """Momentum update + DCT + top-k + error feedback in place; ``(idx, vals)`` for all blocks."""
    if hasattr(fc, "fused_encode_many"):
        return fc.fused_encode_many(deltas, grads, lr, decay, layouts, k, encoding)
    parts = [fc.fused_encode(d, g, lr, decay, L, k, encoding) for d, g, L in zip(deltas, grads, layouts)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def fused_decode_bucket(params, idx: torch.Tensor, vals: torch.Tensor, lr: float, layouts: list[BlockLayout]) -> None:
    """``p -= lr * sign(IDCT(mean over selecting replicas))`` for every tensor of the bucket."""
    if hasattr(fc, "fused_mean_decode_update_many"):
        fc.fused_mean_decode_update_many(params, idx, vals, lr, layouts)
        return
    row = 0
    for p, L in zip(params, layouts):
        rows = slice(row, row + L.num_blocks)
        fc.fused_mean_decode_update(p, idx[:, rows].contiguous(), vals[:, rows].contiguous(), lr, L)
        row += L.num_blocks
