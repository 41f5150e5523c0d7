"""DiLoCo's outer state and step. The state, per parameter (:class:`Entry`): the global copy,
outer momentum and error feedback, on the parameters' device or in pinned host memory, and its
checkpoint form: what every replica shares under ``prefix``, what differs per replica under
``replica_prefix``.

The step (:class:`OuterSGD`): ``torch.optim.SGD`` (dampening 0, no weight decay; Nesterov or not)
on the global copies, the replicas' outer gradient written into their ``.grad`` as in torchft's
``local_sgd.DiLoCo``. Its momentum buffers ARE the entries' ``momentum`` tensors (put into the
SGD's state before its first step), so checkpoints, healing and the replica check keep the keys
and tensors they had when the step was written by hand, and an old checkpoint loads unchanged.

With the state in pinned host memory (``state_device="cpu"``) the optimizer object is not used,
for a measured reason: ``torch.optim.SGD`` steps tensors where they live, so it would run on
the host's cores (the outer gradient copied down, the new global copy up). One step of 0.99 B
fp32 parameters (Nesterov) on one H200 with 16 host cores, torch 2.11: 759 ms that way, 301 ms
streamed as below, 13.7 ms with the state on the GPU (0.27 B: 220 / 82 / 3.8 ms). Instead
each tensor is streamed through the device (global copy and momentum up, the step, both back)
and stepped by ``torch.optim.sgd.sgd``, the same optimizer's functional form: the same kernels,
so host state gives the same bits as device state.

Summation order: torch's SGD computes what the hand-written step it replaced did, per element
and in the same order (``m = mu * m + g``; ``g + mu * m`` (Nesterov); ``p - lr * step``); on
CUDA through its ``_foreach`` kernels over a bucket instead of one kernel per tensor. Measured
against that hand-written step on the same random parameters and outer gradients (4 Nesterov
steps, lr 0.7, momentum 0.9): bitwise equal, max |difference| 0.0, on CPU (torch 2.13, 34 M
parameters) and on an H200 (torch 2.11, 0.27 B and 0.99 B parameters), device and host state
alike (``benchmarks/outer_step.py --sgd-check``; on the H200 the same torch calls in a standalone
script). Every replica runs the same kernels on the same received bytes, so replicas stay
bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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


class OuterSGD:
    """``step(pairs)``: for each ``(entry, outer_gradient)`` one SGD step of the global copy, then
    the local parameters := the global copy. Entries without a gradient are left alone, so the
    step may run bucket by bucket as the exchange delivers them."""

    def __init__(self, entries: list[Entry], lr: float, momentum: float, nesterov: bool, offload: bool):
        self.lr, self.momentum, self.nesterov, self.offload = lr, momentum, nesterov, offload
        self.optimizer: torch.optim.SGD | None = None
        if entries and not offload:
            self.optimizer = torch.optim.SGD([e.global_copy for e in entries], lr=lr, momentum=momentum,
                                             nesterov=nesterov)
            for e in entries:
                if e.momentum is not None:  # the same tensor: filled in place by a checkpoint load
                    self.optimizer.state[e.global_copy]["momentum_buffer"] = e.momentum

    @torch.no_grad()
    def step(self, pairs: list[tuple[Entry, torch.Tensor]]) -> None:
        if self.offload:
            for e, grad in pairs:
                self._streamed(e, grad)
            return
        for e, grad in pairs:
            e.global_copy.grad = grad.to(e.global_copy.dtype)
        self.optimizer.step()
        for e, _ in pairs:
            e.global_copy.grad = None
            local_tensor(e.param).copy_(e.global_copy)

    def _streamed(self, e: Entry, grad: torch.Tensor) -> None:
        local = local_tensor(e.param)
        glob = e.global_copy.to(local.device, non_blocking=True)
        buf = None if e.momentum is None else e.momentum.to(local.device, non_blocking=True)
        sgd([glob], [grad.to(glob.dtype)], [buf], weight_decay=0.0, momentum=self.momentum, lr=self.lr,
            dampening=0.0, nesterov=self.nesterov, maximize=False)
        local.copy_(glob)
        e.global_copy.copy_(glob, non_blocking=True)
        if buf is not None:
            e.momentum.copy_(buf, non_blocking=True)
