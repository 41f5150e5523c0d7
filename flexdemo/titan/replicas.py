"""Keeping replicas identical over a fixed replica group (``dp_replicate``): the start-up sync
(``[flexdemo] init_sync``, called by parallelize once the weights exist), the periodic check and
resync (``replica_check_interval`` / ``replica_check_action``, called by the optimizers container),
and the digests logged with them. Elastic replicas take the same check over torchft's group."""

import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.tools.logging import logger

from flexdemo.local import local_tensor
from flexdemo.replica_check import ReplicaMismatchError, check_replicas_identical
from flexdemo.replica_group import ReplicaGroup, replica_group


def replicate_group(parallel_dims) -> dist.ProcessGroup | None:
    """The process group over ``dp_replicate`` (None: one replica)."""
    mesh = parallel_dims.get_optional_mesh("dp_replicate")
    return None if mesh is None else mesh.get_group()


class ReplicaSyncError(RuntimeError):
    """Replicas were found to differ; raised on every rank together."""


def local_named_params(model_parts: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, local shard) per parameter; equal shard index -> equal data across replicas."""
    for i, part in enumerate(model_parts):
        prefix = f"part{i}." if len(model_parts) > 1 else ""
        for name, p in part.named_parameters():
            yield prefix + name, local_tensor(p.detach())


def param_digest(hashes: torch.Tensor) -> str:
    """Fingerprint of this rank's local parameter bits, to compare across replicas in logs,
    from the per-tensor hashes the replica check already computed on the device."""
    return hashlib.sha256(hashes.cpu().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def broadcast_from_replica0(model_parts: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Overwrite every replica's params/buffers with replica 0's (same shard index)."""
    for part in model_parts:
        for t in [*part.parameters(), *part.buffers()]:
            dist.broadcast(local_tensor(t.detach()), group=group, group_src=0)


def start_identical(model_parts: list[nn.Module], group: dist.ProcessGroup | None, init_sync: str) -> None:
    """``[flexdemo] init_sync`` on initialised weights: "broadcast" replica 0's, "verify" they match, or
    "none"."""
    if group is None:
        return
    if init_sync == "broadcast":
        broadcast_from_replica0(model_parts, group)
        logger.info("flexdemo: broadcast initial params from replica 0")
    elif init_sync == "verify":  # before the optimizers (and their replica group) exist
        verify_identical(local_named_params(model_parts), "param", replica_group(group), step=0)


@torch.no_grad()
def verify_or_resync(model_parts: list[nn.Module], group: ReplicaGroup, step: int, action: str, sync) -> bool:
    """:func:`verify_identical`; on a mismatch with ``action="resync"`` (a fixed group only) every
    replica takes replica 0's parameters (and, with an outer step, its global copy and momentum)
    and training goes on, logged. Returns whether it re-synced."""
    try:
        verify_identical(sync.shared_tensors(local_named_params(model_parts)), sync.checked, group, step)
        return False
    except ReplicaSyncError:
        if action != "resync":
            raise
    process_group = group.process_group  # config validation: resync needs a fixed group
    broadcast_from_replica0(model_parts, process_group)
    for _, t in sync.shared_tensors([]):
        dist.broadcast(local_tensor(t), group=process_group, group_src=0)
    logger.warning(f"flexdemo: replicas differed at step {step}; every replica re-synced from replica 0, going on")
    verify_identical(sync.shared_tensors(local_named_params(model_parts)), sync.checked, group, step)
    return True


def verify_identical(named_tensors: list, what: str, group: ReplicaGroup, step: int) -> str:
    """flexdemo.replica_check over the replica group, fixed or elastic (it agrees over this job's
    world, so every rank raises together), on ``named_tensors``, the one set every replica holds
    alike (``what``: "param", or an outer step's "global copy" and momentum: the run's replica
    sync names them, flexdemo.titan.replica_sync). Logs the verdict and the digest of this rank's
    hashes (compare it across replicas in the logs); stops training on a mismatch."""
    try:
        hashes = check_replicas_identical(named_tensors, group)
    except ReplicaMismatchError as e:
        msg = f"flexdemo: replica check failed at step {step}: {e}"
        logger.error(msg)
        raise ReplicaSyncError(msg) from e
    digest = param_digest(hashes) if hashes is not None else "-"
    logger.info(f"flexdemo: replica check at step {step}: {group.size()} replicas identical "
                f"(local {what} digest {digest})")
    return digest
