"""DiLoCo's per-parameter state (global copy, outer momentum, error feedback, on the parameters'
device or in pinned host memory) and its checkpoint form: what every replica shares under
``prefix``, what differs per replica under ``replica_prefix``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from flexdemo.local import local_tensor


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


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor shaped like ``param``: a DTensor with the parameter's sharding whose
    local shard IS ``local`` (on whatever device it lives), or ``local`` itself. DTensor.from_local
    would move a host tensor to the mesh's device; the constructor (as FSDP2 uses it for its
    CPU-offloaded shards) keeps it in place, so DCP reads and writes the state's own storage."""
    if not isinstance(param, DTensor):
        return local
    return DTensor(local, param._spec, requires_grad=False)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    src = local_tensor(src)
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)
