"""Keeping replicas identical over a fixed replica group (``dp_replicate``): the start-up sync
(``[flexdemo] init_sync``, called by parallelize once the weights exist), the periodic check and
resync (``replica_check_interval`` / ``replica_check_action``, called by the optimizers container),
and the digests logged with them. Elastic replicas check theirs in flexdemo.titan.elastic."""

import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.tools.logging import logger

from flexdemo.local import local_tensor


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
    elif init_sync == "verify":
        verify_identical(model_parts, group, step=0)


@torch.no_grad()
def verify_or_resync(model_parts: list[nn.Module], group: dist.ProcessGroup, step: int, action: str,
                     shared_state=()) -> bool:
    """:func:`verify_identical`; on a mismatch with ``action="resync"`` every replica takes replica
    0's parameters (and ``shared_state``, tensors every replica must hold alike, such as the
    DiLoCo global copy) and training goes on, logged. Returns whether it re-synced."""
    try:
        verify_identical(model_parts, group, step)
        return False
    except ReplicaSyncError:
        if action != "resync":
            raise
    broadcast_from_replica0(model_parts, group)
    for t in shared_state:
        dist.broadcast(local_tensor(t), group=group, group_src=0)
    logger.warning(f"flexdemo: replicas differed at step {step}; every replica re-synced from replica 0, going on")
    verify_identical(model_parts, group, step)
    return True


def verify_identical(model_parts: list[nn.Module], group: dist.ProcessGroup, step: int) -> None:
    """flexdemo.replica_check over the replica group (it agrees world-wide, so every
    rank raises together); log the verdict and stop training on a mismatch."""
    from flexdemo.replica_check import ReplicaMismatchError, check_replicas_identical

    try:
        hashes = check_replicas_identical(local_named_params(model_parts), group)
    except ReplicaMismatchError as e:
        msg = f"flexdemo: replica check failed at step {step}: {e}"
        logger.error(msg)
        raise ReplicaSyncError(msg) from e
    logger.info(
        f"flexdemo: replicas identical at step {step} "
        f"(local param digest {param_digest(hashes)})"
    )
