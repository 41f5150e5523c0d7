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
on that copy exactly as for an fp32 momentum, and the result is rounded back: on CUDA by one
Triton kernel (:mod:`flexdemo.kernels.rounding`), elsewhere by torch ops, the same bits.

The rounding's random bits are a hash of (the element's position in the whole, unsharded
tensor, a seed from the parameter's index and a counter the optimizer saves with its state:
:mod:`flexdemo.wire.stochastic_rounding`), not a random generator's stream. So they are the same
whatever the FSDP/TP layout (a sharded run rounds as an unsharded one, and a checkpoint resumed
on another layout continues them), and a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import torch

from flexdemo.kernels import INTERPRET
from flexdemo.kernels.common import HAVE_TRITON
from flexdemo.kernels.rounding import fused_stochastic_round
from flexdemo.wire.stochastic_rounding import box_of, rounding_seed, stochastic_round_torch

MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Elements widened to fp32 at a time: bounds the working copy to a few hundred MB whatever the
# bucket's size (a single larger tensor is widened alone).
CHUNK_ELEMENTS = 1 << 25

__all__ = ["MOMENTUM_DTYPES", "check_momentum_dtype", "chunks", "round_into", "rounding_seed"]


def check_momentum_dtype(name) -> torch.dtype:
    if name not in MOMENTUM_DTYPES:
        raise ValueError(f"DeMo: momentum_dtype must be one of {tuple(MOMENTUM_DTYPES)}, got {name!r}")
    return MOMENTUM_DTYPES[name]


def round_into(out: torch.Tensor, x: torch.Tensor, param: torch.Tensor, seed: int, fused: bool = True) -> None:
    """``out`` (the bf16 local momentum of ``param``) = ``x`` (fp32) stochastically rounded."""
    box = box_of(param)
    device = x.device.type
    if fused and HAVE_TRITON and (device == "cuda" or (device == "cpu" and INTERPRET)) \
            and x.is_contiguous() and out.is_contiguous():
        fused_stochastic_round(out, x, box, seed)
    else:
        stochastic_round_torch(out, x, box, seed)


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
