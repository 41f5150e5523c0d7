"""DiLoCo's outer state and step. The state, per parameter (:class:`Entry`): the global copy,
outer momentum and error feedback, on the parameters' device or in pinned host memory, and its
checkpoint form: what every replica shares under ``prefix``, what differs per replica under
``replica_prefix``.

The step (:class:`OuterStep`): the caller's ``torch.optim.SGD`` (dampening 0, no weight decay;
Nesterov or not), given to DiLoCo at construction as torchft's ``local_sgd.DiLoCo`` takes its
outer optimizer, over the model's parameters. As torchft does, the parameters are set to the
global copy, the replicas' outer gradient is written into their ``.grad`` and the optimizer's
``step()`` moves them; the global copy then takes their values. Its momentum buffers ARE the
entries' ``momentum`` tensors (put into the optimizer's state at construction), so checkpoints,
healing and the replica check keep the keys and tensors they had when the step was written by
hand, and an old checkpoint loads unchanged. Another optimizer (Adam as the outer one) is refused:
its state would be in none of those. The optimizer's ``step()`` over the parameters, not a copy of
its arithmetic on the global copies, is what runs, so its param group is the one truth: its lr is
read at every step. It costs one parameter-sized copy per outer step more than stepping the global
copies (parameters := global before the step, global := parameters after, against local :=
global): 4 bytes read and 4 written per fp32 parameter, about 2 ms at 0.99 B parameters from an
H200's memory bandwidth, once per ``sync_interval`` (an estimate, not yet timed on a GPU). Against
the global-copy step it replaced: bitwise equal on CPU (torch 2.13; plain, DTensor and mixed
parameters, device and host state, with and without SGD's foreach kernels, which CUDA uses), and
the same torch calls on the same values; not yet run on a GPU.

With the state in pinned host memory (``state_device="cpu"``) the optimizer's ``step()`` is not
called, for a measured reason: ``torch.optim.SGD`` steps tensors where they live, so its state
would have to be on the host and it would run on the host's cores (the outer gradient copied
down, the new global copy up). One step of 0.99 B fp32 parameters (Nesterov) on one H200 with
16 host cores, torch 2.11: 759 ms that way, 301 ms streamed as below, 13.7 ms with the state on
the GPU (0.27 B: 220 / 82 / 3.8 ms). Instead each tensor is streamed through the device (global
copy into the parameter, momentum up, the step, both back) and stepped by
``torch.optim.sgd.sgd``, the functional form ``SGD.step`` calls, with the optimizer's param group
settings: the same kernels, so host state gives the same bits as device state.

Summation order: torch's SGD computes what the hand-written step it replaced did, per element
and in the same order (``m = mu * m + g``; ``g + mu * m`` (Nesterov); ``p - lr * step``); on
CUDA through its ``_foreach`` kernels over a bucket instead of one kernel per tensor. Measured
against that hand-written step on the same random parameters and outer gradients (4 Nesterov
steps, lr 0.7, momentum 0.9): bitwise equal, max |difference| 0.0, on CPU (torch 2.13, 34 M
parameters) and on an H200 (torch 2.11, 0.27 B and 0.99 B parameters), device and host state
alike (``benchmarks/outer_step.py --sgd-check``, then on the global copies; on the H200 the same
torch calls in a standalone script). Every replica runs the same kernels on the same received bytes, so replicas stay
bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.optim.sgd import sgd

from flexdemo.local import like_param, local_tensor


@dataclass
class Entry:
    name: str
    param: torch.Tensor
    global_copy: torch.Tensor  # local-shard-shaped, on the state device
    momentum: torch.Tensor | None
    error_feedback: torch.Tensor | None


def new_entry(name: str, param: torch.Tensor, offload: bool, momentum: bool, error_feedback: bool) -> Entry:
    """Zeroed state for ``param``'s local shard: on its device, or (``offload``) in host memory,
    pinned when the parameter is on CUDA."""
    local = local_tensor(param)

    def buffer():
        if not offload:
            return torch.zeros_like(local)
        return torch.zeros(local.shape, dtype=local.dtype, pin_memory=local.is_cuda)

    return Entry(name, param, buffer(), buffer() if momentum else None, buffer() if error_feedback else None)


def entries_state_dict(entries: list[Entry], prefix: str, replica_prefix: str) -> dict[str, torch.Tensor]:
    """Per entry: the global copy and momentum under ``prefix``, the error feedback and a host copy
    of the local parameters under ``replica_prefix``; shaped like the parameters (see :func:`like_param`)."""
    sd = {}
    for e in entries:
        sd[f"{prefix}global.{e.name}"] = like_param(e.global_copy, e.param)
        if e.momentum is not None:
            sd[f"{prefix}momentum.{e.name}"] = like_param(e.momentum, e.param)
        if e.error_feedback is not None:
            sd[f"{replica_prefix}error_feedback.{e.name}"] = like_param(e.error_feedback, e.param)
        # A host copy: saving must not hold a second copy of the parameters on the device.
        local = local_tensor(e.param).detach().to("cpu", copy=True)
        sd[f"{replica_prefix}local.{e.name}"] = like_param(local, e.param)
    return sd


@torch.no_grad()
def load_entries(entries: list[Entry], sd: dict[str, torch.Tensor], prefix: str, replica_prefix: str) -> None:
    """The inverse of :func:`entries_state_dict`, into the state and the parameters in place."""
    for e in entries:
        copy_in(e.global_copy, sd[f"{prefix}global.{e.name}"])
        if e.momentum is not None:
            copy_in(e.momentum, sd[f"{prefix}momentum.{e.name}"])
        if e.error_feedback is not None:
            copy_in(e.error_feedback, sd[f"{replica_prefix}error_feedback.{e.name}"])
        copy_in(local_tensor(e.param), sd[f"{replica_prefix}local.{e.name}"])


def shared_copies(entries: list[Entry]) -> dict[str, torch.Tensor]:
    """What a rejoining elastic replica takes from a live peer: the global copies and outer
    momenta, as host copies (torchft sends them while this replica goes on training)."""
    sd = {}
    for e in entries:
        sd[f"global.{e.name}"] = e.global_copy.detach().to("cpu", copy=True)
        if e.momentum is not None:
            sd[f"momentum.{e.name}"] = e.momentum.detach().to("cpu", copy=True)
    return sd


@torch.no_grad()
def load_shared_copies(entries: list[Entry], sd: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`shared_copies`; the local parameters := the global copy (a cycle
    starts from it). The error feedback stays this replica's own."""
    for e in entries:
        e.global_copy.copy_(sd[f"global.{e.name}"])
        if e.momentum is not None:
            e.momentum.copy_(sd[f"momentum.{e.name}"])
        local_tensor(e.param).copy_(e.global_copy)


def entry_keys(entries: list[Entry], prefix: str, replica_prefix: str) -> list[str]:
    """The keys of :func:`entries_state_dict`, in its order."""
    keys = []
    for e in entries:
        keys.append(f"{prefix}global.{e.name}")
        if e.momentum is not None:
            keys.append(f"{prefix}momentum.{e.name}")
        if e.error_feedback is not None:
            keys.append(f"{replica_prefix}error_feedback.{e.name}")
        keys.append(f"{replica_prefix}local.{e.name}")
    return keys


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    src = local_tensor(src)
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


# the param group's settings DiLoCo's outer step fixes at construction (only the lr may change)
FIXED_SETTINGS = ("momentum", "nesterov", "dampening", "weight_decay", "maximize")


def outer_sgd(params, lr: float, momentum: float, nesterov: bool) -> torch.optim.SGD:
    """The outer optimizer the TOML keys describe (``outer_lr``, ``outer_momentum``,
    ``outer_nesterov``): ``torch.optim.SGD`` over ``params``, to pass as ``DiLoCo(outer_optimizer=)``."""
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, nesterov=nesterov)


def outer_param_group(optimizer, params: list[torch.Tensor], names: list[str]) -> dict:
    """The one param group of ``optimizer`` that holds every parameter of ``params`` (named
    ``names``); TypeError / ValueError (``DiLoCo: ...``) for what DiLoCo's outer step cannot take."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DiLoCo: outer_optimizer must be a torch.optim.Optimizer instance, e.g. "
                        f"torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True); "
                        f"got {type(optimizer).__name__}")
    if not isinstance(optimizer, torch.optim.SGD):
        raise TypeError(
            f"DiLoCo: outer_optimizer must be a torch.optim.SGD, got {type(optimizer).__name__}: DiLoCo's "
            "checkpoint (state_dict), the state a rejoining elastic replica receives and the settings "
            "the replicas compare at start hold SGD's lr, momentum and momentum buffer only, so another "
            "optimizer's state would be lost at a restart or a heal")
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    missing = [n for n, p in zip(names, params) if id(p) not in group_of]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(f"DiLoCo: outer_optimizer does not hold the parameters {missing[:3]}{more}: build it "
                         "over (a superset of) the parameters DiLoCo syncs, the same tensor objects")
    groups = sorted({group_of[id(p)] for p in params})
    if len(groups) > 1:
        raise ValueError(f"DiLoCo: the parameters DiLoCo syncs are in param groups {groups} of outer_optimizer: "
                         "put them in one (the replicas agree on one outer lr, momentum and Nesterov)")
    group = optimizer.param_groups[groups[0] if groups else 0]
    unsupported = {k: group[k] for k, plain in (("dampening", 0), ("weight_decay", 0), ("maximize", False))
                   if group.get(k, plain) != plain}
    if unsupported:
        raise ValueError(
            f"DiLoCo: outer_optimizer's {unsupported} is not supported: its outer step is SGD with dampening 0, "
            "no weight decay, minimizing (the streamed step of state_device=\"cpu\" implements only that, and "
            "the replicas' start-up agreement compares only lr, momentum and Nesterov)")
    with_state = [n for n, p in zip(names, params) if optimizer.state.get(p)]
    if with_state:
        raise ValueError(f"DiLoCo: outer_optimizer already holds state for {with_state[:3]}: pass a fresh one "
                         "(DiLoCo keeps the outer momentum itself and restores it by its load_state_dict)")
    return group


class OuterStep:
    """``step(pairs)``: for each ``(entry, outer_gradient)`` one step of the caller's outer
    optimizer (a ``torch.optim.SGD`` over the model's parameters, as torchft's DiLoCo takes it)
    from the global copy, then the global copy := the result; the local parameters end equal to
    it. Entries without a gradient are left alone, so the step may run bucket by bucket as the
    exchange delivers them.

    On the device (``offload`` False), per bucket, as torchft's ``_StreamingDiLoCoFragment``
    does: the local parameters := the global copy; their ``.grad`` := the outer gradient (a DTensor
    with the parameter's sharding where the parameter is one); ``optimizer.step()``; the global
    copy := the parameters. Every other parameter of the optimizer has its ``.grad`` (an inner
    gradient, say) set aside during the step, so only this bucket moves, and every ``.grad`` is
    given back after it. The momentum buffers in the optimizer's ``state`` ARE the entries'
    ``momentum`` tensors (as DTensors sharing their storage where the parameters are DTensors),
    so a checkpoint load or a heal fills them in place. A TP rank that does not own a replicated
    parameter has no entry for it: no gradient, so the optimizer leaves it (the owner's values are
    mirrored to it after the step).

    With the state in host memory (``offload``) the optimizer's ``step()`` is not called (it would
    step the parameters with their state where it lives): its param group's settings, read at each
    step, drive ``torch.optim.sgd.sgd`` (the same functional form SGD.step calls) per streamed tensor,
    the momentum buffer brought to the device and back.

    The lr is read from the param group at every step (an lr scheduler on the optimizer takes
    effect at the next outer step); the settings of :data:`FIXED_SETTINGS` may not change."""

    def __init__(self, optimizer: torch.optim.SGD, group: dict, entries: list[Entry], offload: bool):
        self.optimizer, self.group, self.entries, self.offload = optimizer, group, entries, offload
        self.fixed = {k: group.get(k) for k in FIXED_SETTINGS}
        self._buffers = {}  # id(param) -> the momentum buffer put into the optimizer's state
        if not offload:
            for e in entries:
                if e.momentum is not None:  # the same storage: filled in place by a checkpoint load
                    self._buffers[id(e.param)] = like_param(e.momentum, e.param)
                    optimizer.state[e.param]["momentum_buffer"] = self._buffers[id(e.param)]

    @property
    def lr(self) -> float:
        return self.group["lr"]

    @torch.no_grad()
    def step(self, pairs: list[tuple[Entry, torch.Tensor]]) -> None:
        self._check_settings(pairs)
        if self.offload:
            for e, grad in pairs:
                self._streamed(e, grad)
            return
        stepped = {id(e.param) for e, _ in pairs}
        aside = [(p, p.grad) for g in self.optimizer.param_groups for p in g["params"]
                 if p.grad is not None and id(p) not in stepped]
        own = [(e.param, e.param.grad) for e, _ in pairs]
        try:
            for p, _ in aside:
                p.grad = None
            # torch's foreach kernels take a list of DTensors or of plain tensors, not both: one step each
            for kind in (True, False):
                some = [(e, grad) for e, grad in pairs if isinstance(e.param, DTensor) == kind]
                if not some:
                    continue
                for e, grad in some:
                    local = local_tensor(e.param)
                    local.copy_(e.global_copy)
                    e.param.grad = like_param(grad.to(local.dtype), e.param)
                self.optimizer.step()
                for e, _ in some:
                    e.param.grad = None
                    e.global_copy.copy_(local_tensor(e.param))
        finally:
            for p, g in aside + own:
                p.grad = g

    def _streamed(self, e: Entry, grad: torch.Tensor) -> None:
        local = local_tensor(e.param)
        local.copy_(e.global_copy, non_blocking=True)
        buf = None if e.momentum is None else e.momentum.to(local.device, non_blocking=True)
        g = self.group
        sgd([local], [grad.to(local.dtype)], [buf], weight_decay=0.0, momentum=g["momentum"], lr=g["lr"],
            dampening=0.0, nesterov=g["nesterov"], maximize=False, foreach=g.get("foreach"), fused=g.get("fused"))
        e.global_copy.copy_(local, non_blocking=True)
        if buf is not None:
            e.momentum.copy_(buf, non_blocking=True)

    def _check_settings(self, pairs) -> None:
        changed = {k: (v, self.group.get(k)) for k, v in self.fixed.items() if self.group.get(k) != v}
        if changed:
            raise ValueError(f"DiLoCo: the outer optimizer's settings changed since construction "
                             f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())}): only its lr "
                             "may change (the state DiLoCo keeps and the replicas' agreed settings depend on them)")
        for e, _ in pairs:
            buf = self._buffers.get(id(e.param))
            if buf is not None and self.optimizer.state[e.param].get("momentum_buffer") is not buf:
                raise RuntimeError(
                    f"DiLoCo: the outer optimizer's momentum buffer of {e.name} was replaced (by its "
                    "load_state_dict?): DiLoCo holds the outer momentum; restore it by DiLoCo.load_state_dict")
