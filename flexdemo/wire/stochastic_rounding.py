"""Stochastic rounding of fp32 to bf16 with bits that depend only on where an element sits.

The random bits of an element are a 32-bit hash of (its index in the row-major unsharded tensor,
a seed): whatever FSDP/TP layout holds the tensor, and whichever path rounds it (these torch ops
or the Triton kernel of :mod:`flexdemo.kernels.rounding`), the same element with the same seed
rounds the same way. This module is the definition; the kernel is tested bit-equal to it.

A local tensor is described as a :class:`Box` of the whole: ``rows x cols x inner`` elements
starting at (``row0``, ``col0``), the whole having ``full_cols`` columns (dims past the second
are never sharded by FSDP or TP here, so ``inner`` is whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

MASK32 = 0xFFFFFFFF
MIX = 0x45D9F3B  # the xor-shift-multiply finaliser's multiplier
ROWS_PER_SLICE_ELEMENTS = 1 << 22  # the torch path rounds this many elements at a time


@dataclass(frozen=True)
class Box:
    rows: int
    cols: int
    inner: int
    row0: int = 0
    col0: int = 0
    full_cols: int = 0  # 0: cols (the tensor is whole along dim 1)

    @property
    def whole_cols(self) -> int:
        return self.full_cols or self.cols


def box_of(t: torch.Tensor) -> Box:
    """Where the local part of ``t`` (a DTensor, or a whole tensor) sits in the whole tensor."""
    shape = tuple(t.shape)
    if isinstance(t, DTensor):
        local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    else:
        local, offset = shape, (0,) * len(shape)
    if len(shape) == 0:
        return Box(1, 1, 1)
    if len(shape) == 1:
        return Box(local[0], 1, 1, row0=offset[0], full_cols=1)
    if any(o != 0 for o in offset[2:]) or tuple(local[2:]) != shape[2:]:
        raise NotImplementedError(f"stochastic rounding: a tensor sharded past its second dim ({t.placements})")
    inner = 1
    for n in shape[2:]:
        inner *= n
    return Box(local[0], local[1], inner, row0=offset[0], col0=offset[1], full_cols=shape[1])


def mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding 32-bit values (products stay below 2**59)."""
    h = ((h ^ (h >> 16)) * MIX) & MASK32
    h = ((h ^ (h >> 16)) * MIX) & MASK32
    return h ^ (h >> 16)


def rounding_seed(param_index: int, counter: int, phase: int) -> int:
    """A 32-bit seed per (parameter, step counter, phase)."""
    h = torch.tensor([(param_index * 0x9E3779B1 + counter * 2 + phase) & MASK32], dtype=torch.int64)
    return int(mix32(mix32(h))[0])


def positions(box: Box, first_row: int, n_rows: int, device) -> torch.Tensor:
    """Whole-tensor indices (int64, ``[n_rows, cols, inner]``) of local rows ``first_row ...``."""
    r = torch.arange(box.row0 + first_row, box.row0 + first_row + n_rows, dtype=torch.int64, device=device)
    c = torch.arange(box.col0, box.col0 + box.cols, dtype=torch.int64, device=device)
    k = torch.arange(box.inner, dtype=torch.int64, device=device)
    return (r[:, None, None] * box.whole_cols + c[None, :, None]) * box.inner + k[None, None, :]


def round_slice(x: torch.Tensor, pos: torch.Tensor, seed: int) -> torch.Tensor:
    """bf16 of ``x`` (fp32): 16 random bits added to the 16 bits bf16 drops, then cut off, so the
    magnitude rounds up with probability equal to its distance from the bf16 value below (the
    sign bit is apart: unbiased for either sign); values bf16 holds exactly stay; non-finite
    values stay as they are."""
    noise = (mix32((pos ^ seed) & MASK32) & 0xFFFF).to(torch.int32)
    rounded = ((x.view(torch.int32) + noise) & -65536).view(torch.float32)  # -65536 = 0xFFFF0000
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)  # exact: low bits zero


def stochastic_round_torch(out: torch.Tensor, x: torch.Tensor, box: Box, seed: int) -> None:
    """``out`` (bf16, the local tensor) = ``x`` (fp32, same shape) rounded, a slice of rows at a
    time (bounded temporaries)."""
    if x.numel() == 0:
        return
    xs, outs = x.reshape(box.rows, box.cols, box.inner), out.view(box.rows, box.cols, box.inner)
    step = max(1, ROWS_PER_SLICE_ELEMENTS // max(1, box.cols * box.inner))
    for r in range(0, box.rows, step):
        n = min(step, box.rows - r)
        outs[r:r + n].copy_(round_slice(xs[r:r + n], positions(box, r, n, x.device), seed))
