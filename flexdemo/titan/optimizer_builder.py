"""build_optimizers_fn for flexdemo train specs.

mode "demo":        DeMo on every model part (FSDP-sharded DTensor params; DeMo exchanges
                    compressed momentum over dp_replicate inside step()).
mode "diloco" /
mode "demo_diloco": torchtitan's Adam/AdamW from [optimizer] inside each replica, and the
                    DiLoCo outer step (dense / DCT top-k compressed) every sync_interval steps.
mode "off":         torchtitan's Adam/AdamW from [optimizer]; replicas are kept equal by HSDP.

All return a :class:`~flexdemo.titan.optimizer_container.FlexOptimizersContainer`. The model
is not changed here: parallelize.py made the replicas start identical and scaled their
gradients before this runs.
"""

import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.optim.diloco import DiLoCo

from .checkpoint_format import format_key, format_tag, plan_resume
from . import elastic
from .config import DILOCO_MODES, FlexDemoConfigError, describe_exchange, flexdemo_section
from .ignored_keys import ignored_keys
from .exchange_accounting import modelled_hsdp_allreduce_bytes
from .optimizer_container import FlexOptimizersContainer
from .replicas import replicate_group
from .torchtitan_workarounds import adam_class_and_kwargs


def build_flexdemo_optimizers(model_parts: list[nn.Module], parallel_dims: ParallelDims,
                              job_config) -> FlexOptimizersContainer:
    """The flexdemo train specs' optimizers for ``model_parts`` (their spec passes the job config:
    torchtitan_workarounds.with_job_config)."""
    optimizer_config = job_config.optimizer
    cfg = flexdemo_section(job_config)
    group = replicate_group(parallel_dims)
    replicas, shards = parallel_dims.dp_replicate, parallel_dims.dp_shard * parallel_dims.cp
    checkpoint = {
        "format_key": format_key(format_tag(cfg), replicas, shards),
        "resume": plan_resume(job_config, cfg, replicas, shards, FlexDemoConfigError),
    }
    if elastic.enabled(job_config):  # replicas are separate jobs; torchft decides who takes part
        group = elastic.elastic_group(job_config)
        checkpoint["elastic_replica_id"] = job_config.fault_tolerance.replica_id
    ignored = ignored_keys(job_config)
    if ignored:
        logger.warning(f"flexdemo: mode={cfg.mode} does not use {', '.join(ignored)} (set in the config; ignored)")

    if cfg.mode == "off":
        cls, kwargs = adam_class_and_kwargs(optimizer_config, cfg.mode)
        modelled = modelled_hsdp_allreduce_bytes(
            model_parts, parallel_dims, TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
        )
        logger.info(f"flexdemo: mode=off, {optimizer_config.name} + stock HSDP")
        return _container(model_parts, cls, kwargs, cfg, group, checkpoint, modelled_bytes_per_step=modelled,
                          per_replica_state=False)  # HSDP keeps AdamW state identical across replicas

    # Every other mode keeps replicas apart: parallelize.py made them start identical and
    # scaled their gradients to replica means (keep_replicas_apart).
    if cfg.mode in DILOCO_MODES:
        steps = job_config.training.steps
        if steps % cfg.sync_interval:
            logger.warning(
                f"flexdemo: training.steps={steps} is not a multiple of sync_interval={cfg.sync_interval}: "
                f"the last {steps % cfg.sync_interval} steps end without an outer step, and the model "
                "saved last is each replica's own local one"
            )
        return _build_diloco(model_parts, optimizer_config, parallel_dims, cfg, group, checkpoint)

    from flexdemo.optim import DeMo

    kwargs = {
        "lr": optimizer_config.lr,
        "compression_decay": cfg.decay,
        "compression_topk": cfg.topk,
        "compression_chunk": cfg.chunk,
        "weight_decay": cfg.weight_decay,
        "replicate_group": group,
        "value_encoding": cfg.value_encoding,
        "overlap": cfg.overlap,
        "lookahead": cfg.overlap_lookahead,
        "kernel_precision": cfg.kernel_precision,
        "exchange_timeout": cfg.exchange_timeout_seconds or None,
        "nonfinite": cfg.nonfinite,
        "exchange": cfg.exchange,
        "sharded_topk": cfg.sharded_topk,
        "index_coding": cfg.index_coding,
    }
    logger.info(
        f"flexdemo: DeMo(topk={cfg.topk}, chunk={cfg.chunk}, decay={cfg.decay}, "
        f"values={cfg.value_encoding}, overlap={cfg.overlap}{', lookahead' if cfg.overlap_lookahead else ''}, "
        f"exchange={describe_exchange(cfg, cfg.topk)}) "
        f"over dp_replicate={parallel_dims.dp_replicate}"
    )
    return _container(model_parts, DeMo, kwargs, cfg, group, checkpoint, per_replica_state=True,
                      last_step=job_config.training.steps, max_consecutive_skips=cfg.max_consecutive_skips)


def _build_diloco(model_parts, optimizer_config, parallel_dims: ParallelDims, cfg, group,
                  checkpoint: dict) -> FlexOptimizersContainer:
    if len(model_parts) != 1:  # validation rejects pipeline parallelism in these modes
        raise FlexDemoConfigError(f"mode={cfg.mode!r} needs one model part, got {len(model_parts)}")
    topk = cfg.mode == "demo_diloco"
    outer = DiLoCo(
        model_parts[0].named_parameters(),
        sync_interval=cfg.sync_interval,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        nesterov=cfg.outer_nesterov,
        compression="topk" if topk else "dense",
        value_encoding=cfg.outer_value_encoding,
        topk=cfg.outer_topk,
        chunk=cfg.outer_chunk,
        decay=cfg.outer_decay,
        replicate_group=group,
        state_device=cfg.outer_state_device,
        kernel_precision=cfg.kernel_precision,
        exchange_timeout=cfg.exchange_timeout_seconds or None,
        nonfinite=cfg.nonfinite,
        max_consecutive_skips=cfg.max_consecutive_skips,
        exchange=cfg.exchange,
        sharded_topk=cfg.sharded_topk,
        index_coding=cfg.index_coding,
    )
    cls, kwargs = adam_class_and_kwargs(optimizer_config, cfg.mode)
    compression = (
        f"DCT top-k (topk={cfg.outer_topk}, chunk={cfg.outer_chunk}, decay={cfg.outer_decay}, "
        f"exchange={describe_exchange(cfg, cfg.outer_topk)})" if topk else "dense"
    )
    logger.info(
        f"flexdemo: mode={cfg.mode}: {optimizer_config.name} inside each replica, outer step every "
        f"{cfg.sync_interval} steps over dp_replicate={parallel_dims.dp_replicate}: {compression}, "
        f"{cfg.outer_value_encoding} values, SGD lr={cfg.outer_lr} momentum={cfg.outer_momentum} "
        f"nesterov={cfg.outer_nesterov}, state on {cfg.outer_state_device} "
        f"({outer.state_bytes_per_param()} bytes/param)"
    )
    return _container(model_parts, cls, kwargs, cfg, group, checkpoint,
                      per_replica_state=True, outer=outer)  # each replica's AdamW state is its own


def _container(model_parts, cls: type, kwargs: dict, cfg, group, checkpoint: dict, *,
               per_replica_state: bool, modelled_bytes_per_step: int | None = None,
               **extra) -> FlexOptimizersContainer:
    """The optimizers container every mode returns: the replica group and check, its checkpoint
    keys, and the mode's own ``extra`` arguments."""
    return FlexOptimizersContainer(
        model_parts, cls, kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=modelled_bytes_per_step,
        per_replica_state=per_replica_state,
        **checkpoint,
        **extra,
    )
