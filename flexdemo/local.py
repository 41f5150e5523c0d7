"""The rank-local part of a tensor, DTensor or not."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor (a view sharing storage) of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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
