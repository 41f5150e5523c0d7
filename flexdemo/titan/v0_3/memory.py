"""The pre-flight's memory estimate per GPU on torchtitan 0.3.0 (``[flexdemo] memory_check``):
flexdemo.titan.memory's (the same terms, line, warning and refusal as 0.2.2), shown the 0.3.0
config through 0.2.2's names, the shapes read off 0.3.0's model built on the meta device (a fused
``wqkv`` per block, ``lm_head``: flexdemo.titan.memory.model_shapes reads both).

0.3.0's activation checkpointing is a component: none, ``FullAC`` ("full"), ``SelectiveAC`` (per
op: "selective op"), ``MemoryBudgetAC`` ("memory_budget", counted as none as on 0.2.2). Its
selective AC saves every other matmul of the fused projections (wqkv, w1, w2: one kv projection
more than 0.2.2's wq, wv, w1, w2 per token), which the estimate does not tell apart."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC

from .. import memory


def model_shapes(config) -> memory.ModelShapes:
    spec = config.model_spec

    def build_meta():
        with torch.device("meta"):
            return spec.model.build()

    return memory.cached_shapes((spec.name, spec.flavor), build_meta)


def _activation_checkpoint(ac) -> SimpleNamespace:
    if isinstance(ac, FullAC.Config):
        return SimpleNamespace(mode="full", selective_ac_option="")
    if isinstance(ac, SelectiveAC.Config):
        return SimpleNamespace(mode="selective", selective_ac_option="op")
    if isinstance(ac, MemoryBudgetAC.Config):
        return SimpleNamespace(mode="memory_budget", selective_ac_option="")
    return SimpleNamespace(mode="none", selective_ac_option="")


def estimate_view(config) -> SimpleNamespace:
    """The fields of a 0.2.2 job config that flexdemo.titan.memory reads, from a FlexTrainer.Config."""
    p = config.parallelism
    return SimpleNamespace(
        flexdemo=config.flexdemo,
        model=SimpleNamespace(name=config.model_spec.name, flavor=config.model_spec.flavor),
        parallelism=SimpleNamespace(
            data_parallel_replicate_degree=p.data_parallel_replicate_degree,
            data_parallel_shard_degree=p.data_parallel_shard_degree,
            tensor_parallel_degree=p.tensor_parallel_degree, pipeline_parallel_degree=p.pipeline_parallel_degree,
            context_parallel_degree=p.context_parallel_degree, expert_parallel_degree=p.expert_parallel_degree,
            disable_loss_parallel=getattr(p, "disable_loss_parallel", False)),
        training=config.training,  # local_batch_size, seq_len, mixed_precision_param/_reduce: 0.2.2's names
        activation_checkpoint=_activation_checkpoint(config.activation_checkpoint),
    )


def estimate(config, world_size: int | None, device_total: int | None = None, device_name: str = "CPU"):
    return memory.estimate_memory(estimate_view(config), world_size, device_total, device_name,
                                  shapes=model_shapes(config))


def check_memory(config, world_size: int | None, say) -> None:
    """The estimate's line, then a warning or (``"refuse"``) a FlexDemoConfigError (flexdemo.titan.memory.check)."""
    memory.check(estimate_view(config), world_size, say, shapes=lambda: model_shapes(config))
