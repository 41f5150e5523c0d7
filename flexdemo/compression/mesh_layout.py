"""How a replica's parameters lie on its device mesh: the replicate group must cross that mesh
(:func:`check_replicate_group`), the groups that span a replica's shards (:func:`shard_groups_of`),
and the parameters tensor parallelism replicates inside a replica (:class:`TPReplicated`).

The last (torchtitan's TP plans: the 1-D norm weights) cross the slow link once per replica,
not once per TP rank.

Every TP rank holds the same bits of such a parameter, so one of them, the *owner* (coordinate 0
on each mesh dimension that replicates it), compresses and exchanges it as any other; the
others leave it out of their exchange and, after each update, take the owner's values over the
replica's own fast link (:meth:`TPReplicated.mirror`, one broadcast of them all per mesh
dimension). The optimizer state of such a parameter lives on its owner only: a checkpoint holds
the owner's (DCP saves what some rank has and loads what each rank asks for), so it resumes on
any TP degree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from flexdemo.compression.exchange import distributed
from flexdemo.local import local_tensor
from flexdemo.replica_group import ReplicaGroup


def check_replicate_group(params, group: ReplicaGroup, who: str) -> None:
    """All DTensor params must live on one mesh, orthogonal to the replicate group: the group
    must hold exactly one rank of each shard group, so that every rank exchanges its own shard
    with the same shard of the other replicas (``group.global_ranks()``: its members in this
    job's world; a torchft group spans jobs, one replica each, and names only this rank)."""
    mesh = None
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if any(isinstance(pl, Partial) for pl in p.placements):
            raise ValueError(f"{who}: parameters with Partial placements are not supported")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError(
                f"{who}: parameters live on different device meshes ({mesh} and {p.device_mesh}); "
                f"{who} exchanges local shards of one mesh over one replicate group"
            )
    if mesh is None or not distributed():
        return
    replica_ranks = set(group.global_ranks())
    overlap = replica_ranks & set(mesh.mesh.flatten().tolist())
    if overlap != {dist.get_rank()}:
        raise ValueError(
            f"{who}: the replicate group {sorted(replica_ranks)} overlaps the parameters' mesh "
            f"{mesh.mesh.tolist()} in ranks {sorted(overlap)}; the replicate group must contain exactly "
            "one rank of each shard group (pass the dp_replicate group, not the world)"
        )


def shard_groups_of(params) -> tuple:
    """The groups spanning a replica's shards: one per dimension of the DTensor parameters' mesh
    (FSDP, TP, or both), those of one rank left out. A MAX or a union taken over each in turn
    covers every shard of the replica (a 2-D mesh: its rows, then its columns)."""
    for p in params:
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            mesh = p.device_mesh
            return tuple(mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1)
    return ()


def replicated_dims(p: torch.Tensor) -> tuple[int, ...]:
    """The mesh dimensions (of size > 1) over which the DTensor ``p`` is replicated; () otherwise."""
    if not isinstance(p, DTensor):
        return ()
    return tuple(d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate) and p.device_mesh.size(d) > 1)


class TPReplicated:
    """The parameters (of ``params``) replicated over mesh dimensions inside the replica, and
    whether this rank owns them. All share one mesh (checked by ``check_replicate_group``)."""

    def __init__(self, params: list[torch.Tensor]):
        with_dims = [(p, replicated_dims(p)) for p in params]
        self.params = [p for p, dims in with_dims if dims]
        self.owner, self._groups = True, []
        self._elsewhere: frozenset[int] = frozenset()  # ids of the parameters another TP rank owns
        if not self.params or not dist.is_initialized():
            return
        dims = {d for _, d in with_dims if d}
        if len(dims) > 1:
            raise ValueError(f"parameters replicated over different mesh dimensions {sorted(dims)}: "
                             "one set is supported (torchtitan's TP plans replicate over tp only)")
        dims = dims.pop()
        mesh = self.params[0].device_mesh
        coordinate = mesh.get_coordinate()
        self.owner = all(coordinate[d] == 0 for d in dims)
        self._groups = [mesh.get_group(d) for d in dims]
        if not self.owner:
            self._elsewhere = frozenset(id(p) for p in self.params)

    def exchanged(self, p: torch.Tensor) -> bool:
        """Whether this rank exchanges (and keeps optimizer state for) ``p``."""
        return id(p) not in self._elsewhere

    def mirror(self, extra: list[torch.Tensor] = ()) -> None:
        """Every TP rank := the owner's values of the replicated parameters (and of ``extra``,
        tensors laid out like them, e.g. a look-ahead's base), in place: one coalesced
        broadcast per replicating mesh dimension, from its coordinate 0 (after the first, the
        ranks at coordinate 0 of the next hold the owner's values)."""
        if not self._groups:
            return
        tensors = [local_tensor(p.detach()) for p in self.params] + [local_tensor(t) for t in extra]
        if any(t.dtype not in (torch.float32, torch.bfloat16, torch.float16) for t in tensors):
            raise TypeError("TPReplicated.mirror: float32, bfloat16 or float16 tensors only (exact in fp32)")
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        for group in self._groups:
            dist.broadcast(flat, group=group, group_src=0)
        if self.owner:
            return
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
