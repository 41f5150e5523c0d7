"""The optimizers of a flexdemo run: build_optimizers_fn of the flexdemo train specs, and the
torchtitan ``OptimizersContainer`` every mode returns. What each mode builds is its entry in
flexdemo.modes (DeMo; torchtitan's Adam/AdamW from [optimizer], with the DiLoCo outer step in
the DiLoCo modes); this module resolves [optimizer] and the replica group and hands them over.

The model is not changed here: parallelize.py made the replicas start identical and scaled their
gradients before this runs. Keys a config sets that its mode does not read are logged once as a
warning (:func:`ignored_keys`), so that nothing a user set is ignored silently.

:class:`FlexOptimizersContainer` keeps torchtitan's LR schedulers, DCP checkpoints (flattened
optimizer state dicts), step hooks and metrics working unchanged; what it does around the
optimizers' step is flexdemo.titan.container's, shared with the torchtitan 0.3.0 adapter.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.job_config import Optimizer as _TitanOptimizer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.local import local_tensor
from flexdemo.modes import EVERY_MODE_KEYS, mode_of
from flexdemo.replica_group import replica_group

from . import elastic
from . import replicas as rep
from .checkpoint import format_key, plan_resume
from .config import FlexDemo, FlexDemoConfigError, run_settings
from .container import FlexContainer
from .meters import modelled_hsdp_allreduce_bytes
from .torchtitan_workarounds import adam_class_and_kwargs


def build_flexdemo_optimizers(model_parts: list[nn.Module], parallel_dims: ParallelDims,
                              job_config) -> FlexOptimizersContainer:
    """The flexdemo train specs' optimizers for ``model_parts`` (their spec passes the job config:
    torchtitan_workarounds.with_job_config): the mode's builder (flexdemo.modes) in the container."""
    optimizer_config = job_config.optimizer
    settings = run_settings(job_config)  # what the replicas agree on: start-up, checkpoint tag, elastic join
    cfg, spec = settings.section, settings.mode
    # The one replica group of the run, made here once and handed down (a ReplicaGroup; None with
    # one replica): torchft's (replicas are separate jobs, the Lighthouse decides who takes part)
    # or a static one over this job's dp_replicate group.
    process_group = rep.replicate_group(parallel_dims)
    group = None if process_group is None else replica_group(process_group)
    replicas, shards = parallel_dims.dp_replicate, parallel_dims.dp_shard * parallel_dims.cp
    checkpoint = {
        "format_key": format_key(settings.checkpoint_tag, replicas, shards),
        "resume": plan_resume(job_config, settings, replicas, shards, FlexDemoConfigError),
        "job_replicas": replicas,
    }
    if elastic.enabled(job_config):
        group = elastic.elastic_group(job_config)
        checkpoint["replica_index"] = job_config.fault_tolerance.replica_id  # stable whoever is alive
    ignored = ignored_keys(job_config)
    if ignored:
        logger.warning(f"flexdemo: mode={cfg.mode} does not use {', '.join(ignored)} (set in the config; ignored)")
    if group is not None:  # every setting at once, before the optimizers compare their own
        settings.agree(group, local_tensor(next(model_parts[0].parameters())).device)
    inner = adam_class_and_kwargs(optimizer_config, cfg.mode) if spec.inner_optimizer else None
    try:
        built = spec.build(model_parts, cfg, group, inner, lr=optimizer_config.lr, steps=job_config.training.steps,
                           replicas=parallel_dims.dp_replicate, inner_name=optimizer_config.name)
    except ValueError as e:
        raise FlexDemoConfigError(str(e)) from e
    # Modes that keep replicas apart had them start identical and their gradients scaled to replica
    # means in parallelize.py (keep_replicas_apart); HSDP's all-reduce bytes are modelled for the log.
    modelled = None if spec.separate_replicas else modelled_hsdp_allreduce_bytes(
        model_parts, parallel_dims, TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce])
    return FlexOptimizersContainer(
        model_parts, built.optimizer_cls, built.optimizer_kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=modelled,
        per_replica_state=built.per_replica_state,
        run_settings=settings,
        outer=built.outer,
        **checkpoint,
        **built.container_kwargs,
    )


def ignored_keys(job_config) -> list[str]:
    """``section.key`` of every key set to a non-default value that the chosen mode does not read."""
    c: FlexDemo = job_config.flexdemo
    spec = mode_of(c)
    used = {*EVERY_MODE_KEYS, *spec.reads}
    out = [f"flexdemo.{f.name}" for f in fields(FlexDemo)
           if f.name not in used and getattr(c, f.name) != f.default]
    defaults = _TitanOptimizer()
    out += [f"optimizer.{k}" for k in spec.ignores_optimizer_keys
            if getattr(job_config.optimizer, k) != getattr(defaults, k)]
    return out


class FlexOptimizersContainer(FlexContainer, OptimizersContainer):
    """torchtitan 0.2.2's OptimizersContainer with flexdemo's part (flexdemo.titan.container)."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type,
        optimizer_kwargs: dict[str, Any],
        **flex: Any,
    ) -> None:
        OptimizersContainer.__init__(self, model_parts, optimizer_cls, optimizer_kwargs)
        self.setup_flex(model_parts, **flex)
