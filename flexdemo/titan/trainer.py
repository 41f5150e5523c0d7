"""``FlexTrainer``: torchtitan's Trainer with the per-step token count kept inside a replica.

torchtitan normalises each step's loss by the token count of the whole batch mesh, which
costs an all-reduce over every replica each step: a round trip over the slow link that the
modes keeping replicas apart (demo, diloco, demo_diloco) otherwise avoid. Here each
replica normalises by its own tokens (an all-reduce over its FSDP shards, or none), so every
replica's gradient is its own mean gradient, with no rescaling (flexdemo.titan.grad_scaling
is then skipped), and the only per-step traffic between replicas is flexdemo's exchange.

Done through torchtitan's public extension point for trainers (``torchtitan.train.main``
takes the Trainer class; ``python -m flexdemo.titan.run`` passes this one): the trainer's
ParallelDims is shown through a view whose "batch" is the replica's shard group
(torchtitan_workarounds.ReplicaLocalBatch: 0.2.2 has no hook for that group). Logged
losses stay global (flexdemo's metrics processor rescales their average, see metrics.py).
Under torchtitan's own entry point (the stock Trainer) the all-reduce stays and the
gradients are rescaled instead.

With ``[fault_tolerance] enable`` each replica is its own job and every step (in the DiLoCo
modes: every cycle) starts with torchft's quorum (flexdemo.titan.elastic).

With ``overlap_lookahead`` the validator is wrapped to score the replicas' common parameters
(validation.ConsensusValidator); the stock Trainer would score each replica's look-ahead.
"""

from torchtitan.train import Trainer

from . import elastic
from .config import REPLICA_LOCAL_LOSS_ATTR, SEPARATE_REPLICA_MODES
from .torchtitan_workarounds import replica_local_batch_view
from .validation import ConsensusValidator


class FlexTrainer(Trainer):
    def __init__(self, job_config):
        flex = getattr(job_config, "flexdemo", None)
        local = flex is not None and flex.mode in SEPARATE_REPLICA_MODES
        setattr(job_config, REPLICA_LOCAL_LOSS_ATTR, local)
        super().__init__(job_config)
        if local and self.parallel_dims.dp_replicate > 1:
            self.parallel_dims = replica_local_batch_view(self.parallel_dims)
        # overlap_lookahead: validation scores the replicas' common parameters, not one's look-ahead.
        if getattr(self, "validator", None) is not None and flex is not None and flex.overlap_lookahead:
            self.validator = ConsensusValidator(self.validator, self.optimizers.consensus)
        # Elastic replicas (fault_tolerance.enable): torchft's quorum before every step (cycle); a replica
        # behind the others heals there from a live peer (flexdemo.titan.elastic).
        self.elastic_group = elastic.elastic_group(job_config) if elastic.enabled(job_config) else None
        if self.elastic_group is not None:
            elastic.attach(self)

    def train_step(self, data_iterator):
        if self.elastic_group is not None and elastic.quorum_due(self):
            self.elastic_group.start_step()
        return super().train_step(data_iterator)
