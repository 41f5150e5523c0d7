"""Every place flexdemo reaches around torchtitan rather than through an extension point it offers.

Written against torchtitan ``TORCHTITAN_VERSION``; tests/test_torchtitan_workarounds.py fails when
another version is installed, or when the ParallelDims members the views below override change.
Each entry names what torchtitan lacks and the upstream API that would make it unnecessary.

* :class:`ShardOnlyDims` (parallelize): the family's stock parallelize_fn shards over whatever
  ParallelDims says; 0.2.2 has no way to hand it the mesh to shard over. Upstream fix: a
  parallelize_fn argument (or ParallelDims option) naming the data-parallel mesh FSDP shards
  over, with the replicate dimension left to the optimizer.
* :class:`ReplicaLocalBatch` (FlexTrainer): the Trainer normalises the loss by the token count
  over ``parallel_dims.get_mesh("batch")``; 0.2.2 has no hook for that group. Upstream fix: a
  Trainer hook (or TrainSpec field) giving the loss-normalising data-parallel group.
* :func:`after_init_weights` (parallelize): the Trainer calls parallelize_fn on the meta-device
  model and only then ``to_empty`` + ``init_weights``; 0.2.2 has no hook after the weights exist.
  Upstream fix: a TrainSpec hook called with the initialised model parts (before the optimizer
  and the checkpoint load).
* :func:`adam_class_and_kwargs` (optimizer builder): a copy of the optimizer class and kwargs
  that ``torchtitan.components.optimizer.build_optimizers`` computes inline; 0.2.2 exposes no
  function returning them. Upstream fix: such a function (build_optimizers split in two).
* :func:`with_job_config` (train spec): the Trainer hands build_optimizers_fn the ``[optimizer]``
  section only, and flexdemo's builder needs the whole job config (``[flexdemo]``, checkpoint,
  fault tolerance, training); the spec's parallelize_fn, which the Trainer calls first with the
  job config, passes it on. Upstream fix: build_optimizers_fn taking the job config.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
import torch.nn as nn
from torchtitan.distributed import ParallelDims

from flexdemo.section import FlexDemoConfigError  # torchtitan-free: the 0.3.0 adapter reuses the views

TORCHTITAN_VERSION = "0.2.2"


def _view(cls: type, parallel_dims: ParallelDims) -> ParallelDims:
    """An instance of ``cls`` (a ParallelDims subclass) sharing ``parallel_dims``'s fields and meshes,
    without re-running ParallelDims.__post_init__ (no validation, no second mesh)."""
    view = cls.__new__(cls)
    view.__dict__.update(copy.copy(parallel_dims.__dict__))
    return view


class ShardOnlyDims(ParallelDims):
    """ParallelDims view where dp_replicate is invisible to the stock parallelize: FSDP shards over
    the 1-D ``fsdp`` mesh only and never all-reduces across replicas (disabling HSDP's all-reduce
    with set_requires_all_reduce(False) does not work in FSDP2)."""

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        return self.dp_shard * self.cp


def shard_only_view(parallel_dims: ParallelDims) -> ParallelDims:
    parallel_dims.world_mesh  # build meshes first so the view shares them
    return _view(ShardOnlyDims, parallel_dims)


class ReplicaLocalBatch(ParallelDims):
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
    return _view(ReplicaLocalBatch, parallel_dims)


def after_init_weights(model: nn.Module, fn: Callable[[], None]) -> None:
    """Run ``fn`` once, right after the Trainer's ``model.init_weights(...)`` returns (the weights
    are materialised then; tensor hooks registered earlier, on the meta-device parameters, would
    not survive ``to_empty``). Done by shadowing ``init_weights`` on this model instance."""
    init_weights = model.init_weights

    def init_then_fn(*args, **kwargs):
        out = init_weights(*args, **kwargs)
        del model.init_weights  # once: back to the class's method
        fn()
        return out

    model.init_weights = init_then_fn


def adam_class_and_kwargs(optimizer_config, mode: str) -> tuple[type, dict[str, Any]]:
    """The optimizer class and kwargs torchtitan 0.2.2's stock
    ``torchtitan.components.optimizer.build_optimizers`` builds from ``[optimizer]`` (its
    ``optimizer_classes`` / ``optimizer_kwargs``); a config error for another name."""
    classes = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
    if optimizer_config.name not in classes:
        raise FlexDemoConfigError(
            f"[flexdemo] mode={mode!r} supports optimizer.name in {sorted(classes)}, got {optimizer_config.name!r}"
        )
    impl = optimizer_config.implementation
    return classes[optimizer_config.name], {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }


def with_job_config(parallelize_fn: Callable[..., nn.Module], build_optimizers_fn: Callable[..., Any]):
    """A TrainSpec's ``(parallelize_fn, build_optimizers_fn)``, called as torchtitan 0.2.2's Trainer
    calls them: ``build_optimizers_fn(model_parts, parallel_dims, job_config)`` is called with the
    job config that the Trainer passed ``parallelize_fn`` (it parallelizes every model part before
    it builds the optimizers, and passes that builder ``job_config.optimizer`` only)."""
    passed: dict[str, Any] = {}

    @functools.wraps(parallelize_fn)
    def parallelize(model, parallel_dims, job_config, *args, **kwargs):
        passed["job_config"] = job_config
        return parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)

    @functools.wraps(build_optimizers_fn)
    def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        if "job_config" not in passed:
            raise FlexDemoConfigError(
                "flexdemo optimizer builder needs a model parallelized by a flexdemo train spec "
                "(use [model] name = 'flexdemo_llama3' / 'flexdemo_qwen3')"
            )
        return build_optimizers_fn(model_parts, parallel_dims, passed["job_config"])

    return parallelize, build_optimizers
