"""DiLoCo's outer optimizer: ``torch.optim.SGD`` (dampening 0, no weight decay; Nesterov or not)
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

import torch
from torch.optim.sgd import sgd

from flexdemo.local import local_tensor
from flexdemo.optim.diloco_state import Entry

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
