"""parallelize_fn wrapper shared by every flexdemo model family.

mode "off":  the family's stock parallelize (HSDP when dp_replicate > 1).
modes "demo", "diloco", "demo_diloco": the family's stock parallelize, but shown a
             ParallelDims view in which the replicate dimension is hidden -- so FSDP2
             shards over the 1-D ``fsdp`` mesh only and never all-reduces across replicas
             (disabling HSDP's all-reduce with set_requires_all_reduce(False) does not
             work in FSDP2). flexdemo's optimizer then owns the exchange over
             ``dp_replicate``: DeMo every step, or the DiLoCo outer step every H steps.
"""

import copy
import functools
import os

import torch.nn as nn
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from . import cpu_shim
from .config import SEPARATE_REPLICA_MODES, flexdemo_section, validate_job_config

# Attribute on each parallelized model part carrying the job config to the
# optimizer builder (torchtitan passes it only the [optimizer] section).
JOB_CONFIG_ATTR = "_flexdemo_job_config"


class _ShardOnlyDims(ParallelDims):
    """ParallelDims view where dp_replicate is invisible to the stock parallelize."""

    @property
    def dp_replicate_enabled(self) -> bool:
        return False

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        return self.dp_shard * self.cp


def shard_only_view(parallel_dims: ParallelDims) -> ParallelDims:
    parallel_dims.world_mesh  # build meshes first so the view shares them
    view = _ShardOnlyDims.__new__(_ShardOnlyDims)
    view.__dict__.update(copy.copy(parallel_dims.__dict__))
    return view


def wrap_parallelize(stock_fn):
    """Return a parallelize_fn that dispatches on [flexdemo] mode around ``stock_fn``."""

    @functools.wraps(stock_fn)
    def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config, *args, **kwargs):
        cfg = flexdemo_section(job_config)
        validate_job_config(job_config, int(os.environ.get("WORLD_SIZE", parallel_dims.world_size)))
        if cfg.mode in SEPARATE_REPLICA_MODES:
            model = stock_fn(model, shard_only_view(parallel_dims), job_config, *args, **kwargs)
            shards = parallel_dims.dp_shard * parallel_dims.cp
            inside = f"FSDP over the fsdp mesh only ({shards} shards)" if shards > 1 else "no FSDP (1 shard)"
            logger.info(
                f"flexdemo: {inside} inside each replica; mode {cfg.mode} exchanges across "
                f"dp_replicate={parallel_dims.dp_replicate}"
            )
        else:
            model = stock_fn(model, parallel_dims, job_config, *args, **kwargs)
        if cpu_shim.active():
            cpu_shim.fix_fsdp_for_gloo(model)
        setattr(model, JOB_CONFIG_ATTR, job_config)
        return model

    return parallelize
