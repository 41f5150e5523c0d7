"""What a :class:`~flexdemo.optim.diloco.DiLoCo` may be built with: the choices of its outer
exchange and state, and the check of its arguments (one ``DiLoCo: ...`` ValueError each)."""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from flexdemo.wire.dct import TRANSFORMS

Compression = Literal["dense", "topk"]
DenseEncoding = Literal["fp32", "bf16"]  # the dense outer exchange's wire dtype
TopkEncoding = Literal["fp32", "bf16", "scaled_sign", "two_bit"]  # values of the compressed outer exchange
StateDevice = Literal["device", "cpu"]
COMPRESSIONS, STATE_DEVICES = get_args(Compression), get_args(StateDevice)
DENSE_ENCODINGS, TOPK_ENCODINGS = get_args(DenseEncoding), get_args(TopkEncoding)
NONFINITE = ("skip", "stop")  # on a non-finite cycle: discard it on every replica, or raise
WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the dense exchange's, by encoding


def check_args(sync_interval, outer_lr, outer_momentum, nesterov, compression, value_encoding,
               topk, chunk, decay, state_device, max_consecutive_skips, nonfinite, transform="dct") -> None:
    """Raise ValueError (``DiLoCo: ...``) for the first argument out of range."""
    def fail(msg):
        raise ValueError(f"DiLoCo: {msg}")

    if not (isinstance(sync_interval, int) and not isinstance(sync_interval, bool) and sync_interval >= 1):
        fail(f"sync_interval must be an int >= 1, got {sync_interval!r}")
    if not (isinstance(outer_lr, (int, float)) and math.isfinite(outer_lr) and outer_lr > 0):
        fail(f"outer_lr must be a positive number, got {outer_lr!r}")
    if not (isinstance(outer_momentum, (int, float)) and 0.0 <= outer_momentum < 1.0):
        fail(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if not isinstance(nesterov, bool):
        fail(f"nesterov must be True or False, got {nesterov!r}")
    if nesterov and outer_momentum == 0:
        fail("nesterov needs outer_momentum > 0 (plain SGD: nesterov=False, outer_momentum=0)")
    if compression not in COMPRESSIONS:
        fail(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    allowed = DENSE_ENCODINGS if compression == "dense" else TOPK_ENCODINGS
    if value_encoding not in allowed:
        why = " (a bare sign would move every weight by outer_lr)" if value_encoding == "sign" else ""
        fail(f"value_encoding for compression={compression!r} must be one of {allowed}, got {value_encoding!r}{why}")
    if compression == "topk":
        if not (isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1):
            fail(f"topk must be an int >= 1, got {topk!r}")
        if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
            fail(f"chunk must be an int >= 1, got {chunk!r}")
        if not (isinstance(decay, (int, float)) and 0.0 <= decay <= 1.0):
            fail(f"decay must be in [0, 1], got {decay!r}")
        if transform not in TRANSFORMS:
            fail(f"transform must be one of {TRANSFORMS}, got {transform!r}")
    elif transform != "dct":
        fail(f"transform={transform!r} applies to compression='topk' only (the dense mean has no blocks)")
    if state_device not in STATE_DEVICES:
        fail(f"state_device must be one of {STATE_DEVICES}, got {state_device!r}")
    if not (isinstance(max_consecutive_skips, int) and not isinstance(max_consecutive_skips, bool)
            and max_consecutive_skips >= 0):
        fail(f"max_consecutive_skips must be an int >= 0 (0: never stop), got {max_consecutive_skips!r}")
    if nonfinite not in NONFINITE:
        fail(f"nonfinite must be 'skip' or 'stop', got {nonfinite!r}")

