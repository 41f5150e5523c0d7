"""``FlexTrainer``: torchtitan's Trainer with the per-step token count kept inside a replica.

torchtitan normalises each step's loss by the token count of the whole batch mesh, which
costs an all-reduce over every replica each step: a round trip over the slow link that the
modes keeping replicas apart (demo, diloco, demo_diloco) otherwise avoid. Here each
replica normalises by its own tokens (an all-reduce over its FSDP shards, or none), so every
replica's gradient is its own mean gradient, with no rescaling (flexdemo.titan.grad_scaling
is then skipped), and the only per-step traffic between replicas is flexdemo's exchange.

Done through torchtitan's public extension point for trainers (``torchtitan.train.main``
takes the Trainer class; ``python -m flexdemo.titan.run`` passes this one): the trainer's
ParallelDims is shown through a view whose "batch" is the replica's shard group. Logged
losses stay global (flexdemo's metrics processor rescales their average, see metrics.py).
Under torchtitan's own entry point (the stock Trainer) the all-reduce stays and the
gradients are rescaled instead.
"""

import copy

from torchtitan.distributed import ParallelDims
from torchtitan.train import Trainer

from .config import REPLICA_LOCAL_LOSS_ATTR, SEPARATE_REPLICA_MODES


class _ReplicaLocalBatch(ParallelDims):
    """A ParallelDims view in which the data-parallel "batch" is one replica's shards."""

    @property
    def dp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        # The logged loss stays global: torchtitan sums it over all data-parallel ranks.
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def get_mesh(self, dims):
        if dims == "batch":
            return super().get_mesh("fsdp")
        return super().get_mesh(dims)


def replica_local_batch_view(parallel_dims: ParallelDims) -> ParallelDims:
    view = _ReplicaLocalBatch.__new__(_ReplicaLocalBatch)
    view.__dict__.update(copy.copy(parallel_dims.__dict__))
    return view


class FlexTrainer(Trainer):
    def __init__(self, job_config):
        flex = getattr(job_config, "flexdemo", None)
        local = flex is not None and flex.mode in SEPARATE_REPLICA_MODES
        setattr(job_config, REPLICA_LOCAL_LOSS_ATTR, local)
        super().__init__(job_config)
        if local and self.parallel_dims.dp_replicate > 1:
            self.parallel_dims = replica_local_batch_view(self.parallel_dims)
