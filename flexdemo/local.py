"""The rank-local part of a tensor, DTensor or not."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor (a view sharing storage) of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor shaped like ``param``: a DTensor with the parameter's sharding whose
    local shard IS ``local`` (on whatever device it lives), or ``local`` itself. DTensor.from_local
    would move a host tensor to the mesh's device; the constructor (as FSDP2 uses it for its
    CPU-offloaded shards) keeps it in place, so DCP reads and writes the state's own storage."""
    if not isinstance(param, DTensor):
        return local
    return DTensor(local, param._spec, requires_grad=False)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The rank-local part of ``p``'s gradient, laid out as ``p``'s own local part: a DTensor
    gradient whose placements differ from the parameter's (tensor parallelism gives a row-sharded
    embedding a replicated gradient) is redistributed to them first (from Replicate a local slice)."""
    g = p.grad
    if g is None:
        return None
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


def describe_layout(p: torch.Tensor) -> str:
    """How a DTensor is laid out over its mesh, for the replicas' start-up agreement (e.g.
    " as (Shard(dim=0), Shard(dim=1)) over fsdp=2 x tp=2"); "" for a plain tensor."""
    if not isinstance(p, DTensor):
        return ""
    mesh = p.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = " x ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f" as ({', '.join(repr(x) for x in p.placements)}) over {dims}"
