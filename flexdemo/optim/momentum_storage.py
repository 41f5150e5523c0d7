"""DeMo's momentum kept in bf16 (2 bytes per parameter instead of 4), without losing what bf16 drops.

The momentum is updated in small steps (``delta = decay * delta + lr * g``, then the sent part
taken out): an increment below half of bf16's spacing at the momentum's size is lost to
round-to-nearest every time, so a bf16 momentum would stop following a small, steady gradient.
Stochastic rounding keeps the expected value instead: the fp32 result is rounded up with
probability equal to its distance from the bf16 value below, so small increments survive on
average. (A Kahan-style compensation term would keep them exactly, but costs the 2 bytes per
parameter this saves.)

All arithmetic stays fp32: each step the stored bf16 momentum is widened into an fp32 working
copy, a bounded number of elements at a time (:func:`chunks`), the encode (torch or fused) runs
on that copy exactly as for an fp32 momentum, and the result is rounded back.

The rounding's random bits are a hash of (the element's position in the whole, unsharded
tensor, the parameter's index, a counter the optimizer saves with its state), not a random
generator's stream. So they are the same whatever the FSDP/TP layout (a sharded run keeps the
bits of an unsharded one, and a checkpoint resumed on another layout continues them), every
replica would draw the same bits for the same element and step, and a resumed run repeats the
uninterrupted one.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Elements widened to fp32 at a time: bounds the working copy (and the rounding's temporaries)
# to a few hundred MB whatever the bucket's size.
CHUNK_ELEMENTS = 1 << 25

_MASK32 = 0xFFFFFFFF


def check_momentum_dtype(name) -> torch.dtype:
    if name not in MOMENTUM_DTYPES:
        raise ValueError(f"DeMo: momentum_dtype must be one of {tuple(MOMENTUM_DTYPES)}, got {name!r}")
    return MOMENTUM_DTYPES[name]


def element_positions(t: torch.Tensor) -> torch.Tensor:
    """Each local element's index in the row-major unsharded tensor (int64, the local shape)."""
    if isinstance(t, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        full_shape = tuple(t.shape)
    else:
        local_shape, offset, full_shape = tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
    device = t.to_local().device if isinstance(t, DTensor) else t.device
    pos = torch.zeros(local_shape, dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(full_shape))):
        coords = torch.arange(offset[d], offset[d] + local_shape[d], dtype=torch.int64, device=device) * stride
        pos += coords.reshape((-1,) + (1,) * (len(full_shape) - 1 - d))
        stride *= full_shape[d]
    return pos


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply finaliser) on int64 tensors holding 32-bit values;
    the products stay below 2**63, so nothing overflows."""
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    h = ((h ^ (h >> 16)) * 0x45D9F3B) & _MASK32
    return h ^ (h >> 16)


def rounding_seed(param_index: int, counter: int, phase: int) -> int:
    """A 32-bit seed per (parameter, step counter, phase): phase 0 is the encode's rounding, 1 a
    restore's, so the two roundings of one step draw different bits."""
    h = torch.tensor([(param_index * 0x9E3779B1 + counter * 2 + phase) & _MASK32], dtype=torch.int64)
    return int(_mix32(_mix32(h))[0])


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, seed: int) -> None:
    """``out`` (bf16) = ``x`` (fp32) rounded to a bf16 neighbour at random, up with probability
    equal to its distance from the one below (in units of their spacing): 16 random bits are
    added to the 16 bits bf16 drops, then those are cut off. The sign bit is apart, so this rounds
    the magnitude and is unbiased for either sign; values bf16 holds exactly are unchanged.
    Non-finite values stay as they are (nothing to keep of them)."""
    noise = (_mix32((positions ^ seed) & _MASK32) & 0xFFFF).to(torch.int32)
    bits = (x.view(torch.int32) + noise) & -65536  # 0xFFFF0000: what bf16 keeps
    rounded = bits.view(torch.float32)
    out.copy_(torch.where(torch.isfinite(x), rounded, x))  # exact: the low bits are zero


def chunks(sizes: list[int], limit: int = CHUNK_ELEMENTS) -> list[list[int]]:
    """Consecutive member indices in groups of at most ``limit`` elements (a larger one alone)."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out
