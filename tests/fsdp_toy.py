"""The small MLP the optimizer tests shard with FSDP2 on gloo, and its 2-D mesh."""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def replica_mesh(replicate: int, shard: int):
    return init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))


def shard_layers(model: nn.Sequential, mesh) -> nn.Sequential:
    """FSDP2 over ``mesh`` per layer and at the root, summing its reductions (gloo has no PREMUL_SUM)."""
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    return model


def toy_mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    # Rows divide by (2 shards x 64): local shards keep the unsharded 64x64 blocks.
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 256))
