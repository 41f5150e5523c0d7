"""The replica dimension as one protocol: who takes part in an exchange, and its collectives.

Every layer above (the exchange, the optimizers, the consistency checks) talks to a
:class:`ReplicaGroup` and never asks how membership is decided. Two implementations:

* :class:`StaticReplicaGroup` (here): a torch.distributed process group fixed for the run
  (the ``dp_replicate`` group of one torchrun job, or none: one replica);
* :class:`flexdemo.elastic.group.ElasticGroup`: torchft's managed process group, whose members
  the Lighthouse's quorum decides at each step; a failed collective is reported to torchft and
  turns into a ``commit()`` of False, so callers never branch on a failure.

:func:`replica_group` is the one place that turns what a caller passes (a process group, None,
or a ReplicaGroup) into one. This module imports only torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (absent in 2.11).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ReplicaExchangeTimeout(RuntimeError):
    """A collective over the replica group did not complete in time: a peer across the slow
    link is stalled or gone."""


@runtime_checkable
class ReplicaGroup(Protocol):
    """The replicas an exchange runs over. ``size()``/``rank()`` may change between steps only
    where ``membership_fixed`` is False (then an exchange must not stay in flight across steps).
    Collectives give every member the same bytes; ``commit()`` says whether the step's exchange
    may be applied (always True for a fixed group, whose failures raise)."""

    membership_fixed: bool

    def size(self) -> int: ...

    def rank(self) -> int: ...

    def all_gather(self, out: torch.Tensor, mine: torch.Tensor, *, timeout: float | None = None,
                   what: str = "an exchange", async_op: bool = False): ...

    def wait(self, work, timeout: float | None, what: str) -> None: ...

    def all_to_all(self, out: torch.Tensor, mine: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, *, timeout: float | None = None,
                   what: str = "an exchange") -> None: ...

    def global_ranks(self) -> list[int]: ...

    def gather_objects(self, obj) -> list: ...

    def commit(self) -> bool: ...


def wait_for(work, group, timeout: float | None, what: str) -> None:
    """Wait for ``work`` (None: nothing to wait for) at most ``timeout`` seconds (None: the
    process group's own timeout); a failure is reported naming the replica group's ranks."""
    if work is None:
        return
    try:
        if timeout:
            work.wait(timedelta(seconds=timeout))
        else:
            work.wait()
    except Exception as e:  # gloo and NCCL raise different types on a timeout or a lost peer
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        limit = f"{timeout:g} s" if timeout else "the process group's timeout"
        raise ReplicaExchangeTimeout(
            f"{what} over the replica group (ranks {ranks}) did not complete within {limit}: a peer on the "
            f"replica link is stalled or gone ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class StaticReplicaGroup:
    """A torch.distributed process group fixed for the run (``None``: the default group, or
    one replica where torch.distributed is not initialized)."""

    membership_fixed = True

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        self.process_group = process_group

    def size(self) -> int:
        return dist.get_world_size(self.process_group) if _initialized() else 1

    def rank(self) -> int:
        return dist.get_rank(self.process_group) if _initialized() else 0

    def global_ranks(self) -> list[int]:
        """The world ranks of the members, in group order (for messages and layout checks)."""
        if not _initialized():
            return [0]
        return dist.get_process_group_ranks(self.process_group or dist.group.WORLD)

    def all_gather(self, out, mine, *, timeout=None, what="an exchange", async_op=False):
        """``out`` (``[size, n]``, contiguous) gets every member's ``mine``. ``async_op``: the
        work is returned unwaited (wait with :func:`wait_for`); else waited for here."""
        work = all_gather_flat(out.view(-1), mine, group=self.process_group, async_op=True)
        if async_op:
            return work
        wait_for(work, self.process_group, timeout, what)
        return None

    def wait(self, work, timeout: float | None, what: str) -> None:
        """Wait for what :meth:`all_gather` returned with ``async_op`` (see :func:`wait_for`)."""
        wait_for(work, self.process_group, timeout, what)

    def all_to_all(self, out, mine, out_splits=None, in_splits=None, *, timeout=None, what="an exchange"):
        work = dist.all_to_all_single(out, mine, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.process_group, async_op=True)
        wait_for(work, self.process_group, timeout, what)

    def gather_objects(self, obj) -> list:
        if self.size() == 1:
            return [obj]
        out = [None] * self.size()
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def commit(self) -> bool:
        return True


def replica_group(group) -> ReplicaGroup:
    """``group`` as a :class:`ReplicaGroup`: itself if it is one, else a static group around a
    torch.distributed process group (or None)."""
    if isinstance(group, ReplicaGroup):
        return group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"a replica group must be a torch.distributed ProcessGroup, None or a ReplicaGroup, "
                        f"got {type(group).__name__}")
    return StaticReplicaGroup(group)
