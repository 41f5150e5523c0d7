"""Where DeMo keeps its momentum, and how a step reads and writes it: fp32 (4 bytes per
parameter), or bf16 (2) without losing what bf16 drops.

The momentum is updated in small steps (``delta = decay * delta + lr * g``, then the sent part
taken out): an increment below half of bf16's spacing at the momentum's size is lost to
round-to-nearest every time, so a bf16 momentum would stop following a small, steady gradient.
Stochastic rounding keeps the expected value instead: the fp32 result is rounded up with
probability equal to its distance from the bf16 value below, so small increments survive on
average. (A Kahan-style compensation term would keep them exactly, but costs the 2 bytes per
parameter this saves.)

All arithmetic stays fp32: each step the stored bf16 momentum is widened into an fp32 working
copy, a bounded number of elements at a time, the encode (torch or fused) runs on that copy
exactly as for an fp32 momentum, and the result is rounded back: on CUDA by one Triton kernel
(:mod:`flexdemo.kernels.rounding`), elsewhere by torch ops, the same bits.

The rounding's random bits are a hash of (the element's position in the whole, unsharded
tensor, a seed from the parameter's index and a counter saved with the optimizer state:
:mod:`flexdemo.wire.stochastic_rounding`), not a random generator's stream. So they are the same
whatever the FSDP/TP layout (a sharded run rounds as an unsharded one, and a checkpoint resumed
on another layout continues them), and a resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import torch

from flexdemo.kernels import INTERPRET
from flexdemo.kernels.common import HAVE_TRITON
from flexdemo.kernels.rounding import fused_stochastic_round
from flexdemo.local import local_tensor
from flexdemo.optim.bounded_groups import bounded_groups
from flexdemo.wire.stochastic_rounding import Box, box_of, rounding_seed, stochastic_round_torch

MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Elements widened to fp32 at a time: bounds the working copy to a few hundred MB whatever the
# bucket's size (a single larger tensor is widened alone).
CHUNK_ELEMENTS = 1 << 25

# The key of the rounding's counter in each parameter's optimizer state.
COUNTER = "rounding_step"


def check_momentum_dtype(name) -> torch.dtype:
    if name not in MOMENTUM_DTYPES:
        raise ValueError(f"DeMo: momentum_dtype must be one of {tuple(MOMENTUM_DTYPES)}, got {name!r}")
    return MOMENTUM_DTYPES[name]


def round_into(out: torch.Tensor, x: torch.Tensor, box: Box, seed: int, fused: bool = True) -> None:
    """``out`` (a bf16 local momentum, laid out as ``box``) = ``x`` (fp32) stochastically rounded."""
    device = x.device.type
    if fused and HAVE_TRITON and (device == "cuda" or (device == "cpu" and INTERPRET)) \
            and x.is_contiguous() and out.is_contiguous():
        fused_stochastic_round(out, x, box, seed)
    else:
        stochastic_round_torch(out, x, box, seed)


class MomentumStorage:
    """DeMo's momentum ``state[p]["delta"]`` in ``dtype``, through the compressor's select and
    restore. ``bind`` it to the trainable parameters (again when they change)."""

    def __init__(self, dtype: str, fused: bool):
        self.dtype = check_momentum_dtype(dtype)
        self.fused = fused
        self._place: dict[int, tuple[int, Box]] = {}  # id(param) -> (index, box): layouts never change

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    def bind(self, params: list[torch.Tensor]) -> None:
        """Each parameter's place among ``params`` (the same on every replica and layout: part of
        its rounding seed) and its local box of the whole tensor."""
        self._place = {id(p): (i, box_of(p)) for i, p in enumerate(params)} if self.low_precision else {}

    def create(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        if "delta" not in state:
            # Shaped like the parameter (a DTensor if it is one) so DCP can save and reshard it.
            state["delta"] = torch.zeros_like(p, dtype=self.dtype)
            if self.low_precision:  # the rounding's counter: a resumed run draws the same bits
                state[COUNTER] = torch.zeros((), dtype=torch.int64)
        return state["delta"]

    def select(self, comp, bucket, states, grads, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """``comp.select`` over the bucket's momentum (``states``: param -> its state); a bf16 one is
        widened a bounded chunk of members at a time and rounded back."""
        if not self.low_precision:
            return comp.select(bucket, [local_tensor(states[m.param]["delta"]) for m in bucket.members], grads, **kw)
        parts = []
        for members in self._chunks(bucket):
            work = self._widened(bucket, states, members)
            parts.append(comp.select(bucket, work, [grads[i] for i in members], members=members, **kw))
            self._round_back(bucket, states, members, work, phase=0)
        return torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])

    def restore(self, comp, bucket, states, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """``comp.restore``: give back to the bucket's momentum what ``idx``/``vals`` took out."""
        if not self.low_precision:
            comp.restore(bucket, idx, vals, [local_tensor(states[m.param]["delta"]) for m in bucket.members])
            return
        for members in self._chunks(bucket):
            work = self._widened(bucket, states, members)
            comp.restore(bucket, idx, vals, work, members=members)
            self._round_back(bucket, states, members, work, phase=1)

    def count_step(self, states, params) -> None:
        """One step done: the next roundings draw new bits."""
        if self.low_precision:
            for p in params:
                states[p][COUNTER] += 1

    def after_load(self, states, params) -> None:
        """torch's load_state_dict casts state to its parameter's dtype and device: a bf16 momentum
        would come back fp32 (exactly, and twice the memory), the counter as an fp32 on the GPU
        (read every step: a host sync). Both are put back; a momentum saved in fp32 and loaded into
        a bf16 one is rounded to nearest once, with a fresh counter."""
        for p in params:
            state = states.get(p)
            if not state or "delta" not in state:
                continue
            if state["delta"].dtype != self.dtype:
                state["delta"] = state["delta"].to(self.dtype)
            if self.low_precision:
                state[COUNTER] = state.get(COUNTER, torch.zeros(())).to(device="cpu", dtype=torch.int64)

    def _chunks(self, bucket) -> list[list[int]]:
        return bounded_groups([local_tensor(m.param).numel() for m in bucket.members], CHUNK_ELEMENTS)

    def _widened(self, bucket, states, members: list[int]) -> list[torch.Tensor]:
        return [local_tensor(states[bucket.members[i].param]["delta"]).float() for i in members]

    def _round_back(self, bucket, states, members: list[int], work: list[torch.Tensor], phase: int) -> None:
        for i, w in zip(members, work):
            p = bucket.members[i].param
            index, box = self._place[id(p)]
            state = states[p]
            round_into(local_tensor(state["delta"]), w, box, rounding_seed(index, int(state[COUNTER]), phase),
                       fused=self.fused)
