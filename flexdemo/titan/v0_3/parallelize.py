"""The model's parallelize_fn on torchtitan 0.3.0: the family's own, wrapped per [flexdemo] mode
(0.2.2: flexdemo.titan.parallelize). 0.3.0 passes parallelize_fn no job config, so FlexTrainer
makes this wrapper with the run's section (a closure) and puts it in the ModelSpec.

* mode off: the family's stock parallelize: HSDP over dp_replicate x fsdp.
* modes that keep replicas apart (the mode's ``separate_replicas``): the family's parallelize
  shown a ParallelDims view without the replicate dimension (torchtitan_workarounds.ShardOnlyDims,
  version-independent), so FSDP shards over the ``fsdp`` mesh only; once the weights exist,
  replicas start identical ([flexdemo] init_sync). Each replica's loss is normalised by its own
  tokens (FlexTrainer), so FSDP sums over the shards (0.3.0 sets divide factor 1 itself).
"""

from __future__ import annotations

import functools

from torchtitan.tools.logging import logger

from flexdemo.modes import mode_of

from .. import replicas as rep
from ..torchtitan_workarounds import ShardOnlyDims, _view, after_init_weights
from . import cpu_shim


def wrap_parallelize(stock_fn, section):
    @functools.wraps(stock_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        if mode_of(section).separate_replicas:
            model = stock_fn(model, parallel_dims=_view(ShardOnlyDims, parallel_dims), **kwargs)
            shards = parallel_dims.dp_shard * parallel_dims.cp
            inside = f"FSDP over the fsdp mesh only ({shards} shards)" if shards > 1 else "no FSDP (1 shard)"
            logger.info(f"flexdemo: {inside} inside each replica; mode {section.mode} exchanges across "
                        f"dp_replicate={parallel_dims.dp_replicate}")
            after_init_weights(model, lambda: rep.start_identical(
                [model], rep.replicate_group(parallel_dims), section.init_sync))
        else:
            model = stock_fn(model, parallel_dims=parallel_dims, **kwargs)
        if cpu_shim.active():
            cpu_shim.fix_fsdp_for_gloo(model)
        return model

    return parallelize
