"""FlexTrainer for torchtitan 0.3.0: torchtitan's Trainer whose Config adds the [flexdemo] section
(flexdemo.section.FlexDemo, the same dataclass as 0.2.2's) -- as torchtitan's own
experiments/torchft FaultTolerantTrainer adds ``fault_tolerance``. ``FlexTrainer.Config(...).build()``
builds this class, so torchtitan's own ``-m torchtitan.train --module flexdemo.titan.v0_3 --config X``
runs it too.

Before torchtitan builds anything it checks the config (flexdemo.titan.checks) and hands the
run's settings to what 0.3.0 calls without them: the model's parallelize_fn (a closure,
parallelize.py) and the optimizers container (``optimizer.run``, optimizer.FlexRun).

Replica-local loss normalisation, as 0.2.2's FlexTrainer: torchtitan divides each step's loss by
the token count over the "batch" mesh, replicas included (an all-reduce over the slow link each
step); in the modes that keep replicas apart each replica divides by its own tokens instead, so its
gradient is its own mean gradient, through the same ParallelDims view as 0.2.2
(torchtitan_workarounds.ReplicaLocalBatch: "batch" is the replica's shard group).

Elastic replicas (``fault_tolerance``: torchtitan's own TorchFTManager.Config, the keys 0.2.2 has;
torchtitan's FaultTolerantTrainer and its semi-sync DiLoCo are not used): each replica is its own
torchrun job, its ranks read their shard of every replica's data, and flexdemo's exchange runs over
flexdemo.elastic.ElasticGroup (torchft), made by the optimizers container; every step (in the
DiLoCo modes every cycle) starts with torchft's quorum, where a replica behind the others heals from
a live peer -- flexdemo.titan.elastic, as on 0.2.2.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from torchtitan.components.checkpoint import LR_SCHEDULER, MODEL, ModelWrapper
from torchtitan.experiments.torchft import TorchFTManager
from torchtitan.trainer import Trainer

from flexdemo.modes import mode_of
from flexdemo.section import FlexDemo, FlexDemoConfigError

from .. import elastic
from ..validators import ConsensusValidator
from ..torchtitan_workarounds import ReplicaLocalBatch, _view
from .data import FlexDataLoader
from .optimizer import FlexOptimizersContainer, FlexRun
from .parallelize import wrap_parallelize
from .settings import validate


class FlexTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        flexdemo: FlexDemo = field(default_factory=FlexDemo)
        fault_tolerance: TorchFTManager.Config = field(default_factory=TorchFTManager.Config)
        """Elastic replicas over torchft (flexdemo.titan.elastic): enable, replica_id, group_size,
        min_replica_size, process_group, process_group_timeout_ms; semi_sync_method is refused."""

    def __init__(self, config: Config):
        world = os.environ.get("WORLD_SIZE")
        validate(config, int(world) if world else None)
        if not isinstance(config.optimizer, FlexOptimizersContainer.Config):
            raise ValueError("flexdemo's trainer needs optimizer=FlexOptimizersContainer.Config (its TOML reader "
                             "and config_registry make one)")
        section = config.flexdemo
        self._flex_run = FlexRun(config)
        config.optimizer.run = self._flex_run
        if isinstance(config.dataloader, FlexDataLoader.Config):  # its position resharded on resume
            config.dataloader.run = self._flex_run
        spec = config.model_spec
        config.model_spec = dataclasses.replace(spec, parallelize_fn=wrap_parallelize(spec.parallelize_fn, section))
        ft = config.fault_tolerance
        if ft.enable:  # this replica's ranks read their shard of every replica's data
            if not isinstance(config.dataloader, FlexDataLoader.Config):
                raise FlexDemoConfigError("fault_tolerance.enable needs flexdemo's dataloader (FlexDataLoader.Config), "
                                          "which shards the data by replica_id and group_size")
            config.dataloader.elastic = (ft.group_size, ft.replica_id)
        super().__init__(config)
        local = mode_of(section).separate_replicas and self.parallel_dims.dp_replicate > 1
        if local:
            self.parallel_dims = _view(ReplicaLocalBatch, self.parallel_dims)
            # torchtitan sums the replica-local means over every replica: the logged loss is their mean
            self.metrics_processor.loss_scale = 1.0 / self.parallel_dims.dp_replicate
        self._load_replicas_after_model()
        # overlap_lookahead: validation scores the replicas' common parameters, not one's look-ahead.
        if getattr(self, "validator", None) is not None and section.overlap_lookahead:
            self.validator = ConsensusValidator(self.validator, self.optimizers.consensus)
        # Elastic replicas: torchft's quorum before every step (cycle); a replica behind the others
        # heals there from a live peer (flexdemo.titan.elastic).
        self.elastic_group = self.optimizers.replicate_group if elastic.enabled(config) else None
        if self.elastic_group is not None:
            states = getattr(self.checkpointer, "states", None)  # none with checkpoints off
            elastic.attach(self, states or {MODEL: ModelWrapper(self.model_parts), LR_SCHEDULER: self.lr_schedulers})

    def train_step(self, data_iterator):
        if self.elastic_group is not None and elastic.quorum_due(self):
            self.elastic_group.start_step()
        return super().train_step(data_iterator)

    def _load_replicas_after_model(self) -> None:
        """0.3.0's checkpointer loads the model's tensors into the parameters after the optimizers'
        state (dcp.py: ``states[MODEL].load_state_dict`` after ``dcp.load``): the DiLoCo modes' own
        local parameters of each replica are loaded again after it (replica_sync.OuterCycle.load_again).
        Done by shadowing that one object's load_state_dict; upstream fix: load the model first."""
        model_state = getattr(self.checkpointer, "states", {}).get("model")
        if model_state is None:
            return
        load, sync = model_state.load_state_dict, self.optimizers.sync
        sync.keep_loads_for_again()

        def load_then_replicas(state_dict):
            load(state_dict)
            sync.load_again()

        model_state.load_state_dict = load_then_replicas

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        self._flex_run.parallel_dims = parallel_dims  # for the optimizers container, built later
        return parallel_dims
