"""Stochastic rounding fp32 -> bf16 in one pass (the definition and the torch ops that are its
reference: :mod:`flexdemo.wire.stochastic_rounding`). Each program rounds BLOCK consecutive
local elements: it derives their whole-tensor indices from the local box, hashes them with the
seed, and writes bf16. 6 bytes of traffic per element, where the torch ops move ~100."""

from __future__ import annotations

import torch

from flexdemo.kernels.common import HAVE_TRITON
from flexdemo.wire.stochastic_rounding import Box

BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32(h):
        # int64 holding 32-bit values, as the torch definition (MIX = 0x45D9F3B, checked by a test)
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF
        return h ^ (h >> 16)

    @triton.jit
    def _round_kernel(x_ptr, out_ptr, n, cols, inner, row0, col0, whole_cols, seed, BLOCK: tl.constexpr):
        f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        mask = f < n
        per_row = cols * inner
        i = f // per_row
        j = (f % per_row) // inner
        k = f % inner
        pos = ((row0 + i) * whole_cols + col0 + j) * inner + k
        noise = (_mix32((pos ^ seed) & 0xFFFFFFFF) & 0xFFFF).to(tl.int32)
        x = tl.load(x_ptr + f, mask=mask, other=0.0)
        bits = (x.to(tl.int32, bitcast=True) + noise) & -65536
        rounded = bits.to(tl.float32, bitcast=True)
        finite = tl.abs(x) <= 3.4028234663852886e38  # FLT_MAX; false for inf and NaN
        tl.store(out_ptr + f, tl.where(finite, rounded, x).to(tl.bfloat16), mask=mask)


def fused_stochastic_round(out: torch.Tensor, x: torch.Tensor, box: Box, seed: int) -> None:
    """``out`` (bf16, contiguous) = ``x`` (fp32, contiguous, same number of elements) rounded."""
    n = x.numel()
    if n == 0:
        return
    assert x.dtype == torch.float32 and out.dtype == torch.bfloat16 and x.is_contiguous() and out.is_contiguous()
    _round_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, box.cols, box.inner, box.row0, box.col0, box.whole_cols,
                                           seed, BLOCK=BLOCK)
