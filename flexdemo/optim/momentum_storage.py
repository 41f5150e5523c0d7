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

With ``device="cpu"`` the momentum lives in pinned host memory (0 bytes per parameter on the
GPU): each step streams it through the same bounded fp32 working copies (host to GPU, the
encode, GPU to host; on CUDA the copies of neighbouring chunks run on side streams beside the
encode: :mod:`flexdemo.optim.host_copies`), so the payload and the parameters are the same bits
as with the momentum on the GPU. It costs a read and a write of the momentum over the
host link every step (twice with the sharded exchange's give-back).
"""

from __future__ import annotations

import torch

from flexdemo.kernels import INTERPRET
from flexdemo.kernels.common import HAVE_TRITON
from flexdemo.kernels.rounding import fused_stochastic_round
from flexdemo.local import like_param, local_tensor
from flexdemo.optim.bounded_groups import bounded_groups
from flexdemo.optim.host_copies import HostCopies
from flexdemo.wire.stochastic_rounding import Box, box_of, rounding_seed, stochastic_round_torch

MOMENTUM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MOMENTUM_DEVICES = ("device", "cpu")

# Elements widened to fp32 at a time: bounds the working copy to a few hundred MB whatever the
# bucket's size (a single larger tensor is widened alone).
CHUNK_ELEMENTS = 1 << 25

# The key of the rounding's counter in each parameter's optimizer state.
COUNTER = "rounding_step"
# The optimizer-state keys this storage owns (loaded by it, not by torch's cast to the parameter).
KEYS = ("delta", COUNTER)


def check_momentum_dtype(name) -> torch.dtype:
    if name not in MOMENTUM_DTYPES:
        raise ValueError(f"DeMo: momentum_dtype must be one of {tuple(MOMENTUM_DTYPES)}, got {name!r}")
    return MOMENTUM_DTYPES[name]


def check_momentum_device(name) -> str:
    if name not in MOMENTUM_DEVICES:
        raise ValueError(f"DeMo: momentum_device must be one of {MOMENTUM_DEVICES}, got {name!r}")
    return name


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

    def __init__(self, dtype: str, fused: bool, device: str = "device"):
        self.dtype = check_momentum_dtype(dtype)
        self.offload = check_momentum_device(device) == "cpu"
        self.fused = fused
        self._place: dict[int, tuple[int, Box]] = {}  # id(param) -> (index, box): layouts never change
        self._links: dict[torch.device, HostCopies] = {}  # per device: the side streams of host copies

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    @property
    def streamed(self) -> bool:
        """Whether a step works on fp32 copies of the stored momentum (bf16 or on the host)."""
        return self.low_precision or self.offload

    def bind(self, params: list[torch.Tensor]) -> None:
        """Each parameter's place among ``params`` (the same on every replica and layout: part of
        its rounding seed) and its local box of the whole tensor."""
        self._place = {id(p): (i, box_of(p)) for i, p in enumerate(params)} if self.low_precision else {}

    def create(self, p: torch.Tensor, state: dict) -> torch.Tensor:
        if "delta" not in state:
            # Shaped like the parameter (a DTensor if it is one) so DCP can save and reshard it.
            state["delta"] = self._stored(p)
            if self.low_precision:  # the rounding's counter: a resumed run draws the same bits
                state[COUNTER] = torch.zeros((), dtype=torch.int64)
        return state["delta"]

    def select(self, comp, bucket, states, grads, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """``comp.select`` over the bucket's momentum (``states``: param -> its state); a bf16 one is
        widened (or brought from the host) a bounded chunk of members at a time and put back."""
        if not self.streamed:
            return comp.select(bucket, [local_tensor(states[m.param]["delta"]) for m in bucket.members], grads, **kw)
        parts = []
        self._each_chunk(bucket, states, 0, lambda members, work: parts.append(
            comp.select(bucket, work, [grads[i] for i in members], members=members, **kw)))
        return torch.cat([i for i, _ in parts]), torch.cat([v for _, v in parts])

    def restore(self, comp, bucket, states, idx: torch.Tensor, vals: torch.Tensor) -> None:
        """``comp.restore``: give back to the bucket's momentum what ``idx``/``vals`` took out."""
        if not self.streamed:
            comp.restore(bucket, idx, vals, [local_tensor(states[m.param]["delta"]) for m in bucket.members])
            return
        self._each_chunk(bucket, states, 1, lambda members, work: comp.restore(
            bucket, idx, vals, work, members=members))

    def count_step(self, states, params) -> None:
        """One step done: the next roundings draw new bits."""
        if self.low_precision:
            for p in params:
                states[p][COUNTER] += 1

    def split_off(self, state_dict: dict, param_groups: list[dict]) -> tuple[dict, dict]:
        """(``state_dict`` without this storage's keys, {param: its saved momentum and counter}).
        torch's Optimizer.load_state_dict casts every state tensor to its parameter's dtype and
        device, all at once: a bf16 momentum would come back fp32, a host one would land on the
        GPU (a whole momentum there at once, what host memory is for), the counter as an fp32 on
        the GPU (read every step: a host sync). So these keys are loaded by :meth:`adopt`."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in param_groups for p in g["params"]]
        by_id = dict(zip(saved_ids, params))
        rest, mine = {}, {}
        for k, v in state_dict["state"].items():
            if k in by_id and isinstance(v, dict):
                rest[k] = {kk: vv for kk, vv in v.items() if kk not in KEYS}
                mine[by_id[k]] = {kk: vv for kk, vv in v.items() if kk in KEYS}
            else:
                rest[k] = v
        return {**state_dict, "state": rest}, mine

    def adopt(self, states, saved: dict) -> None:
        """Put the momenta :meth:`split_off` took into ``states``, in this storage's dtype and
        place, one tensor at a time; a momentum saved in fp32 and loaded into a bf16 one is
        rounded to nearest once, with a fresh counter. A tensor already in place (DCP loads into
        the state's own tensors) is kept, not copied: a copy would hold a second momentum at once."""
        for p, keys in saved.items():
            if "delta" not in keys:
                continue
            saved_local = local_tensor(keys["delta"])
            states[p]["delta"] = like_param(saved_local, p) if self._in_place(p, saved_local) \
                else self._stored(p, saved_local)
            if self.low_precision:
                states[p][COUNTER] = keys.get(COUNTER, torch.zeros(())).to(device="cpu", dtype=torch.int64)

    def settled(self, params) -> None:
        """Wait for the momentum's copies to the host, before anything reads it there (a state
        dict saved by DCP)."""
        if self.offload and params and local_tensor(params[0]).is_cuda:
            torch.cuda.current_stream(local_tensor(params[0]).device).synchronize()

    def _place_of(self, p: torch.Tensor) -> torch.device:
        return torch.device("cpu") if self.offload else local_tensor(p).device

    def _in_place(self, p: torch.Tensor, t: torch.Tensor) -> bool:
        """Whether ``t`` can be ``p``'s momentum as it is: shape, dtype, place (pinned on the host)."""
        local = local_tensor(p)
        return (t.shape == local.shape and t.dtype == self.dtype and t.device == self._place_of(p)
                and not (self.offload and local.is_cuda and not t.is_pinned()))

    def _stored(self, p: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """A momentum for ``p`` holding ``value`` (its local shard's shape; None: zeros) in this
        storage's dtype, on the parameter's device or in pinned host memory; shaped like ``p`` (a
        DTensor if it is one), so DCP can save and reshard it."""
        local = local_tensor(p)
        out = torch.empty(local.shape, dtype=self.dtype, device=self._place_of(p),
                          pin_memory=self.offload and local.is_cuda)
        if value is None:
            out.zero_()
        else:
            out.copy_(value)
        return like_param(out, p)

    def _chunks(self, bucket) -> list[list[int]]:
        return bounded_groups([local_tensor(m.param).numel() for m in bucket.members], CHUNK_ELEMENTS)

    def _each_chunk(self, bucket, states, phase: int, work_on) -> None:
        """``work_on(members, work)`` over the bucket's momentum a bounded chunk of members at a
        time, on fp32 working copies put back after. With the momentum on the host, the next
        chunk's upload and the last one's download run beside this chunk's encode
        (:mod:`flexdemo.optim.host_copies`): at most three chunks' copies at once."""
        chunks = self._chunks(bucket)
        if not self.offload:  # bf16 beside the parameters: widened and rounded back in place
            for members in chunks:
                work = [local_tensor(states[bucket.members[i].param]["delta"]).float() for i in members]
                work_on(members, work)
                self._round_back(bucket, states, members, work, phase)
            return
        copies = self._copies(local_tensor(bucket.members[0].param).device)
        ahead = self._upload(copies, bucket, states, chunks[0])
        coming_down = []  # (the download, its sources: kept alive until it is waited for)
        for n, members in enumerate(chunks):
            work, uploaded = ahead
            copies.wait(uploaded)
            if len(coming_down) > 1:  # at most the last chunk still going down
                copies.wait(coming_down.pop(0)[0])
            if n + 1 < len(chunks):
                ahead = self._upload(copies, bucket, states, chunks[n + 1])
            work_on(members, work)
            down = self._round_back(bucket, states, members, work, phase)
            coming_down.append((copies.download(down), down))
            del work, down
        copies.finish()

    def _copies(self, device: torch.device) -> HostCopies:
        if device not in self._links:
            self._links[device] = HostCopies(device)
        return self._links[device]

    def _upload(self, copies: HostCopies, bucket, states, members: list[int]):
        """(new fp32 working copies of the members' host momenta on the parameters' device, the
        upload filling them): the step never writes the stored momentum in place."""
        stored = [local_tensor(states[bucket.members[i].param]["delta"]) for i in members]
        work = [torch.empty(t.shape, dtype=torch.float32, device=copies.device) for t in stored]
        return work, copies.upload(list(zip(work, stored)))

    def _round_back(self, bucket, states, members: list[int], work: list[torch.Tensor], phase: int):
        """Put the working copies back (bf16: stochastically rounded); with the momentum on the
        host, returns the (host momentum, GPU tensor) copies still to go down."""
        down = []
        for i, w in zip(members, work):
            p = bucket.members[i].param
            state = states[p]
            stored = local_tensor(state["delta"])
            if not self.low_precision:  # fp32 on the host: the working copy goes back as it is
                down.append((stored, w))
                continue
            index, box = self._place[id(p)]
            # On the host the rounding runs on the GPU into a bf16 copy, which then goes down.
            out = torch.empty_like(w, dtype=self.dtype) if self.offload else stored
            round_into(out, w, box, rounding_seed(index, int(state[COUNTER]), phase), fused=self.fused)
            if self.offload:
                down.append((stored, out))
        return down
