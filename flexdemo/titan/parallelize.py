"""parallelize_fn wrapper shared by every flexdemo model family: every change to the model is
made here, none in the optimizer builder.

mode "off":  the family's stock parallelize (HSDP when dp_replicate > 1).
modes "demo", "diloco", "demo_diloco": the family's stock parallelize, but shown a
             ParallelDims view in which the replicate dimension is hidden -- so FSDP2
             shards over the 1-D ``fsdp`` mesh only and never all-reduces across replicas
             (disabling HSDP's all-reduce with set_requires_all_reduce(False) does not
             work in FSDP2). flexdemo's optimizer then owns the exchange over
             ``dp_replicate``: DeMo every step, or the DiLoCo outer step every H steps.
             Once the Trainer has initialised the weights (torchtitan parallelizes the
             meta-device model first), replicas are made to start identical
             (``[flexdemo] init_sync``: broadcast from replica 0, or verify) and each
             replica's gradient is made its own mean gradient (below). Both run
             before the optimizer is built and before a checkpoint is loaded, which then
             overwrites the broadcast weights on resume.

Each replica's gradient its own mean gradient: torchtitan's stock Trainer divides the loss by
the token count of the whole batch mesh, replicas included, and relies on HSDP's all-reduce to
sum over replicas. Without that all-reduce each replica's grad is (1/replicas) x its own mean
grad: scaling by the replicate degree restores the mean, so clipping and the optimizer see the
same gradient magnitude as single-replica training (exact when replicas see equal token counts,
as with torchtitan's fixed-length packed batches). flexdemo's FlexTrainer normalises by the
replica's own tokens instead (flexdemo.titan.entry): then the factor is 1, and FSDP only has to
sum over the replica's shards.
"""

import functools
import os

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.modes import mode_of

from . import cpu_shim
from . import replicas as rep
from .config import flexdemo_section, replica_local_loss, validate_job_config
from .torchtitan_workarounds import after_init_weights, shard_only_view


def keep_replicas_apart(model: nn.Module, parallel_dims: ParallelDims, job_config) -> None:
    """The modes that keep replicas apart, on an initialised model: replicas start identical
    (``init_sync``), and each replica's gradient is its own mean gradient."""
    cfg = flexdemo_section(job_config)
    rep.start_identical([model], rep.replicate_group(parallel_dims), cfg.init_sync)
    scale_grads_to_replica_mean([model], parallel_dims.dp_replicate, replica_local_loss(job_config))


def wrap_parallelize(stock_fn):
    """Return a parallelize_fn that dispatches on [flexdemo] mode around ``stock_fn``."""

    @functools.wraps(stock_fn)
    def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config, *args, **kwargs):
        cfg = flexdemo_section(job_config)
        validate_job_config(job_config, int(os.environ.get("WORLD_SIZE", parallel_dims.world_size)))
        if mode_of(cfg).separate_replicas:
            model = stock_fn(model, shard_only_view(parallel_dims), job_config, *args, **kwargs)
            shards = parallel_dims.dp_shard * parallel_dims.cp
            inside = f"FSDP over the fsdp mesh only ({shards} shards)" if shards > 1 else "no FSDP (1 shard)"
            logger.info(
                f"flexdemo: {inside} inside each replica; mode {cfg.mode} exchanges across "
                f"dp_replicate={parallel_dims.dp_replicate}"
            )
            after_init_weights(model, functools.partial(keep_replicas_apart, model, parallel_dims, job_config))
        else:
            model = stock_fn(model, parallel_dims, job_config, *args, **kwargs)
        if cpu_shim.active():
            cpu_shim.fix_fsdp_for_gloo(model)
        return model

    return parallelize


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
