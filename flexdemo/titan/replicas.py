"""Keeping replicas identical: start-up sync, periodic verification, digests."""

import hashlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger


class ReplicaSyncError(RuntimeError):
    """Replicas were found to differ; raised on every rank together."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_named_params(model_parts: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, local shard) per parameter; equal shard index -> equal data across replicas."""
    for i, part in enumerate(model_parts):
        prefix = f"part{i}." if len(model_parts) > 1 else ""
        for name, p in part.named_parameters():
            yield prefix + name, _local(p.detach())


def param_digest(model_parts: list[nn.Module]) -> str:
    """Fingerprint of this rank's local parameter bits, to compare across replicas in logs.
    Hashes on the parameters' device (flexdemo.replica_check.tensor_hash); only one small
    int64 vector comes to the host."""
    from flexdemo.replica_check import tensor_hash

    hashes = torch.stack([tensor_hash(t) for _, t in local_named_params(model_parts)])
    return hashlib.sha256(hashes.cpu().numpy().tobytes()).hexdigest()[:16]


@torch.no_grad()
def broadcast_from_replica0(model_parts: list[nn.Module], group: dist.ProcessGroup) -> None:
    """Overwrite every replica's params/buffers with replica 0's (same shard index)."""
    for part in model_parts:
        for t in [*part.parameters(), *part.buffers()]:
            dist.broadcast(_local(t.detach()), group=group, group_src=0)


def verify_identical(model_parts: list[nn.Module], group: dist.ProcessGroup, step: int) -> None:
    """flexdemo.replica_check over the replica group (it agrees world-wide, so every
    rank raises together); log the verdict and stop training on a mismatch."""
    from flexdemo.replica_check import ReplicaMismatchError, check_replicas_identical

    try:
        check_replicas_identical(local_named_params(model_parts), group)
    except ReplicaMismatchError as e:
        msg = f"flexdemo: replica check failed at step {step}: {e}"
        logger.error(msg)
        raise ReplicaSyncError(msg) from e
    logger.info(
        f"flexdemo: replicas identical at step {step} "
        f"(local param digest {param_digest(model_parts)})"
    )
