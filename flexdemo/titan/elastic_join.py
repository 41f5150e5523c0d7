"""What a replica must share with the quorum it joins: its settings and install, compared when
it heals from a live peer (every joining replica does: at step 0 too, torchft's init_sync).

Replicas that train with different settings would pair different collectives or decode the
same bytes differently; over a fixed group flexdemo's start-up agreement catches that
(flexdemo.compression.agreement), but an elastic replica joins a quorum that is already
training. So the peer's settings travel with its state, and the joiner compares them with its
own before it loads anything: a difference refuses it, naming the first setting that differs.
Per-replica settings (replica_id, folders, logging) are not compared."""

from __future__ import annotations

import importlib.metadata
from dataclasses import fields

import torch

from flexdemo.compression.agreement import first_difference
from flexdemo.elastic.group import ElasticJoinError

# (section, keys) of the job config that every replica must share, besides all of [flexdemo].
SHARED_KEYS = (
    ("model", ("name", "flavor")),
    ("training", ("dataset", "seq_len", "local_batch_size", "global_batch_size", "steps", "max_norm",
                  "mixed_precision_param", "mixed_precision_reduce")),
    ("optimizer", ("name", "lr", "eps", "weight_decay", "beta1", "beta2")),
    ("lr_scheduler", ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")),
    ("parallelism", ("data_parallel_shard_degree", "tensor_parallel_degree", "context_parallel_degree")),
    ("fault_tolerance", ("group_size", "min_replica_size", "process_group")),
)
PACKAGES = ("torch", "torchtitan", "torchft", "flexdemo")


def join_settings(job_config) -> list[tuple[str, str]]:
    """The ordered (name, value) settings a replica must share with the quorum it joins."""
    items = [(f"flexdemo.{f.name}", repr(getattr(job_config.flexdemo, f.name))) for f in fields(job_config.flexdemo)]
    for section, keys in SHARED_KEYS:
        part = getattr(job_config, section)
        items += [(f"{section}.{k}", repr(getattr(part, k))) for k in keys if hasattr(part, k)]
    for package in PACKAGES:
        try:
            items.append((f"{package} version", importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            items.append((f"{package} version", "not installed"))
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        items.append(("GPU architecture", f"sm_{major}{minor}"))
    return items


def refuse_if_different(mine: list[tuple[str, str]], quorum: list[tuple[str, str]], replica_id: int) -> None:
    """Raise ElasticJoinError (one line) naming the first setting where this replica differs."""
    diff = first_difference([tuple(x) for x in quorum], mine)
    if diff is not None:
        setting, theirs, ours = diff
        raise ElasticJoinError(
            f"elastic replica {replica_id} refused at join: its {setting} is {ours}, the quorum's is {theirs}; "
            "every replica must run the same settings and install"
        )
