"""Cheap check that replicas are bit-identical: one set of tensors (:func:`shared_tensors`),
one hash, over any replica group (fixed or elastic).

Each rank hashes the raw bits of its local shards (one int64 per tensor), the hashes are
all-gathered over the replica group, and the first tensor whose hashes differ is named.
The verdict is then agreed over the whole world, so that every rank raises the same error
together instead of some ranks stopping while others wait in the next collective.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from flexdemo.local import local_tensor
from flexdemo.replica_group import replica_group

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements hashed at a time, to bound the temporary memory


class ReplicaMismatchError(RuntimeError):
    """Replicas that must be bit-identical are not."""

    def __init__(self, name: str | None, ranks: list[int], unit: str = "ranks"):
        self.name = name  # None: on a rank whose own replicate group agrees (another one differs)
        self.ranks = ranks
        if name is None:
            super().__init__("replicas diverged in another replicate group; stopping")
            return
        super().__init__(f"replicas diverged: parameter {name!r} differs between {unit} {ranks}; stopping")


def tensor_hash(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """An int64 hash of ``t``'s exact bits and positions (0-d tensor on ``device``, default
    ``t``'s own; a host tensor is hashed there chunk by chunk, the same value).

    Bits are read as integers and summed with position-dependent odd weights; int64
    arithmetic wraps, which is exact modular arithmetic, so the result does not depend on
    the reduction order and equal bits always give equal hashes.
    """
    flat = local_tensor(t).detach().reshape(-1)
    if flat.is_floating_point() or flat.is_complex():
        flat = flat.view(_INT_VIEW[flat.element_size()])
    device = flat.device if device is None else torch.device(device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK].to(device, non_blocking=True).to(torch.int64)
        pos = torch.arange(start, start + part.numel(), dtype=torch.int64, device=device)
        weights = pos * 2654435761 + 0x9E3779B97F4A7C1  # odd multiplier mixes positions
        total += (part * (weights | 1)).sum()
    return total + flat.numel()


def shared_tensors(named_params: Iterable[tuple[str, torch.Tensor]], outer=None) -> list[tuple[str, torch.Tensor]]:
    """The one set of tensors every replica must hold bit-identically, over a fixed group and an
    elastic one alike: the parameters' local shards, or with a DiLoCo ``outer`` step the global
    copy and the outer momentum (the parameters equal the global copy right after a committed
    outer step, and are each replica's own after one that was not)."""
    if outer is None:
        return list(named_params)
    return [(f"{kind}.{e.name}", t) for e in outer.entries
            for kind, t in (("global", e.global_copy), ("momentum", e.momentum)) if t is not None]


def check_replicas_identical(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group=None,
    world_group: dist.ProcessGroup | None = None,
) -> torch.Tensor | None:
    """Raise :class:`ReplicaMismatchError` naming the first tensor that differs across ``group``
    (a ReplicaGroup, fixed or elastic, or a process group; None: the whole world).

    Every rank of ``world_group`` (default: the whole world; an elastic replica's own job) must
    call this with its own tensors in the same order; all of them raise, or none does. Returns
    this rank's per-tensor hashes (int64, one per tensor; None without a process group or tensors).
    """
    named = list(named_tensors)
    if not dist.is_initialized() or not named:
        return None
    group = replica_group(group)
    device = local_tensor(named[0][1]).device
    # On the first tensor's device (the GPU): host tensors such as DiLoCo's offloaded state are
    # hashed there too: on an H100 host ~50x faster than by 16 CPU threads (docs/results/replica_check_h100).
    hashes = torch.stack([tensor_hash(t, device) for _, t in named])
    gathered = torch.empty(group.size(), len(named), dtype=torch.int64, device=device)
    group.all_gather(gathered, hashes, what="the replica check")
    differs = (gathered != gathered[0]).any(0)
    mine_differ = bool(differs.any())

    # Agree world-wide, so all ranks raise together (ranks may hold different tensors, e.g. TP
    # ranks that do not own the replicated ones: each names only a mismatch of its own group).
    verdict = torch.tensor([int(mine_differ)], dtype=torch.int64, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=world_group)
    if not int(verdict.item()):
        return hashes
    if not mine_differ:
        raise ReplicaMismatchError(None, [])
    first_bad = int(differs.nonzero()[0])
    # World ranks over a fixed group; over an elastic one (its members are other jobs) the
    # members' places in this step's quorum.
    ranks, unit = group.global_ranks(), "ranks"
    if len(ranks) != group.size():
        ranks, unit = list(range(group.size())), "replicas of this step's quorum"
    bad = [ranks[r] for r in range(len(ranks)) if gathered[r, first_bad] != gathered[0, first_bad]]
    raise ReplicaMismatchError(named[first_bad][0], [ranks[0]] + bad, unit)
