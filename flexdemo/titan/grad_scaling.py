"""Make each replica's gradient its own mean gradient (modes that keep replicas apart).

torchtitan's stock Trainer divides the loss by the token count of the whole batch mesh,
replicas included, and relies on HSDP's all-reduce to sum over replicas. Without that
all-reduce each replica's grad is (1/replicas) x its own mean grad: scaling by the
replicate degree restores the mean, so clipping and the optimizer see the same gradient
magnitude as single-replica training (exact when replicas see equal token counts, as with
torchtitan's fixed-length packed batches). flexdemo's FlexTrainer normalises by the
replica's own tokens instead (flexdemo.titan.trainer): then the factor is 1, and FSDP
only has to sum over the replica's shards.
"""

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def scale_grads_to_replica_mean(model_parts: list[nn.Module], replicas: int, loss_is_replica_local: bool = False) -> None:
    factor = 1 if loss_is_replica_local else replicas
    if replicas == 1:
        return
    for part in model_parts:
        fsdp_modules = [m for m in part.modules() if isinstance(m, FSDPModule)]
        if fsdp_modules:
            # FSDP divides reduce-scattered grads by this factor: 1/factor multiplies by it,
            # before the grads are written, i.e. before clipping and the optimizer; with
            # factor 1 FSDP sums over the shards (whatever the family's parallelize chose).
            for m in fsdp_modules:
                m.set_gradient_divide_factor(1.0 / factor)
        elif factor != 1:
            # No FSDP (one shard per replica): scale each grad as autograd produces
            # it (a tensor hook, so gradient accumulation stays linear).
            for p in part.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g, r=factor: g * r)
