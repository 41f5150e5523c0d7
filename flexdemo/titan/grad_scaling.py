"""Make each replica's gradient its own mean gradient (mode "demo").

torchtitan divides the loss by the token count of the whole batch mesh, replicas
included, and relies on HSDP's all-reduce to sum over replicas.  In mode "demo" there
is no such all-reduce, so each replica's grad is (1/replicas) x its own mean grad.
Scaling by the replicate degree restores the mean so clipping and DeMo see the same
gradient magnitude as single-replica training (exact when replicas see equal token
counts, as with torchtitan's fixed-length packed batches).
"""

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def scale_grads_to_replica_mean(model_parts: list[nn.Module], replicas: int) -> None:
    if replicas == 1:
        return
    for part in model_parts:
        fsdp_modules = [m for m in part.modules() if isinstance(m, FSDPModule)]
        if fsdp_modules:
            # FSDP divides reduce-scattered grads by this factor: 1/R multiplies by R,
            # before the grads are written, i.e. before clipping and the optimizer.
            for m in fsdp_modules:
                m.set_gradient_divide_factor(1.0 / replicas)
        else:
            # No FSDP (one shard per replica): scale each grad as autograd produces
            # it (a tensor hook, so gradient accumulation stays linear).
            for p in part.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g, r=replicas: g * r)
