"""The rank-local part of a tensor, DTensor or not."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor (a view sharing storage) of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
