"""``[experimental] custom_import = "titan_nan_loss"`` (with tests/ on PYTHONPATH), for the fault
tests: flexdemo's train specs, plus ``flexdemo_llama3_nanloss``, flexdemo_llama3 whose training
loss is NaN on one replica at chosen steps -- bad data, through torchtitan's own extension points.

``FLEXDEMO_NAN_STEPS``: ``"5"``, ``"5,6"`` or ``"3-"`` (every step from 3 on);
``FLEXDEMO_NAN_REPLICA``: the replica (default 1). Steps are counted by the loss's calls, so
keep ``[validation]`` off (the validator would call it too).
"""

import dataclasses
import itertools
import os

import torch.distributed as dist
from torchtitan.protocols.train_spec import register_train_spec

import flexdemo.titan.register  # noqa: F401  (flexdemo's own specs)
from flexdemo.titan.spec import family_spec

NAME = "flexdemo_llama3_nanloss"


def _is_bad_step(step: int, spec: str) -> bool:
    for part in filter(None, spec.split(",")):
        first, dash, last = part.partition("-")
        lo = int(first)
        hi = int(last) if last else (None if dash else lo)  # "3-": no end
        if lo <= step and (hi is None or step <= hi):
            return True
    return False


def _replica(job_config) -> int:
    replicas = job_config.parallelism.data_parallel_replicate_degree
    return dist.get_rank() // (dist.get_world_size() // replicas)  # torchtitan's mesh: replicate outermost


def _wrap(build_loss_fn):
    def build(job_config, **kwargs):
        loss_fn = build_loss_fn(job_config, **kwargs)
        spec = os.environ.get("FLEXDEMO_NAN_STEPS", "")
        bad_here = _replica(job_config) == int(os.environ.get("FLEXDEMO_NAN_REPLICA", "1"))
        steps = itertools.count(1)

        def loss(pred, labels):
            out = loss_fn(pred, labels)
            return out * float("nan") if _is_bad_step(next(steps), spec) and bad_here else out

        return loss

    return build


_base = family_spec("llama3")
register_train_spec(NAME, dataclasses.replace(_base, build_loss_fn=_wrap(_base.build_loss_fn)))
