"""Collectives over the replica group (the slow link), through the :class:`ReplicaGroup`
protocol (:mod:`flexdemo.replica_group`: a static process group or torchft's; nothing here asks
which): the packed all_gather of compressed payloads, the dense replica mean of the DiLoCo
baseline, the non-finite flags agreed over a replica's shards, and a timer that does not sync the
host (the replicas' settings agreement: :mod:`.agreement`; the mesh layout: :mod:`.mesh_layout`).

Every function here gives every rank of the group the same bits: the all_gather copies bytes,
and the dense mean is summed in rank order by one owner per chunk, then copied to everyone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flexdemo.replica_group import ReplicaExchangeTimeout, ReplicaGroup, wait_for  # noqa: F401 (re-exported)



@dataclass
class Traffic:
    """Bytes of one exchange on this rank: ``sent`` = its own data that leaves it once,
    ``received`` = other ranks' data that reaches it (what a link of a given rate must carry)."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.sent + other.sent, self.received + other.received)


class NonFiniteError(RuntimeError):
    """A replica saw a non-finite value and was told to stop: raised on every replica alike."""


def nonfinite_flags(tensors, shard_groups, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, without a host sync: whether each of this rank's tensors holds a
    non-finite value (bool [len(tensors)]) and whether any tensor of the replica does (a 0-dim
    fp32 0/1, agreed over the replica's shards by a MAX all-reduce per mesh dimension on the
    fast link)."""
    # One multi-tensor max-|x| pass (NaN propagates through max, inf stays inf): a per-tensor
    # isfinite().all() launched four kernels per tensor, ~14 ms of GPU time per step at 1B.
    # (Empty tensors have no max and count as finite; no index tensor crosses from the host.)
    nonempty = [t for t in tensors if t.numel()]
    norms = iter(torch._foreach_norm(nonempty, float("inf")) if nonempty else [])
    zero = torch.zeros((), device=device)
    each = ~torch.isfinite(torch.stack([next(norms).to(device) if t.numel() else zero for t in tensors])
                           if tensors else zero.new_zeros(0))
    bad = each.any().to(torch.float32)
    for group in shard_groups:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return each, bad


def any_nonfinite(tensors, shard_groups, device: torch.device) -> bool:
    """Whether any of this rank's tensors holds a non-finite value, agreed over the replica's
    shards (:func:`nonfinite_flags`, then one host sync)."""
    return bool(nonfinite_flags(tensors, shard_groups, device)[1].item())


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def gather_payloads(mine: torch.Tensor, group: ReplicaGroup, async_op: bool = False, timeout: float | None = None):
    """ONE all_gather of this rank's uint8 payload: ``([replicas, nbytes] on every rank,
    traffic, work)``. Waited for (at most ``timeout`` s) unless ``async_op``: then the bytes are
    there once ``wait_for(work, ...)`` returns (``work`` is None when nothing is left to wait for)."""
    world, total = group.size(), mine.numel()
    if world == 1 or total == 0:
        return mine.unsqueeze(0), Traffic(total, 0), None
    gathered = torch.empty(world, total, dtype=torch.uint8, device=mine.device)
    work = group.all_gather(gathered, mine, timeout=timeout, what="the compressed exchange", async_op=async_op)
    return gathered, Traffic(total, (world - 1) * total), work


def replica_mean(flat: torch.Tensor, group: ReplicaGroup, wire_dtype: torch.dtype,
                 timeout: float | None = None) -> tuple[torch.Tensor, Traffic]:
    """Mean over the replica group of a flat fp32 tensor, with ``wire_dtype`` on the wire.

    The bytes of a ring all-reduce in two collectives: an all_to_all hands chunk ``r`` of
    every replica to rank ``r``, which sums them in fp32 in rank order and divides by the
    replica count; an all_gather returns every chunk's mean. Each element is computed by
    one rank only, so all ranks hold the same bits (an all_reduce does not promise that).
    """
    world = group.size()
    if world == 1:
        return flat.to(wire_dtype).to(flat.dtype), Traffic()
    n = flat.numel()
    chunk = -(-n // world)
    send = torch.zeros(world * chunk, dtype=wire_dtype, device=flat.device)
    send[:n].copy_(flat)
    recv = torch.empty_like(send)
    group.all_to_all(recv, send, timeout=timeout, what="the dense exchange")
    parts = recv.view(world, chunk)
    mine = torch.zeros(chunk, dtype=torch.float32, device=flat.device)
    for w in range(world):
        mine += parts[w]
    mine /= world
    gathered = torch.empty_like(send)
    group.all_gather(gathered.view(world, chunk), mine.to(wire_dtype), timeout=timeout, what="the dense exchange")
    return gathered[:n].to(flat.dtype), replica_mean_traffic(n, world, send.element_size())


def replica_mean_traffic(n: int, world: int, elem: int) -> Traffic:
    """One rank's bytes in :func:`replica_mean` of ``n`` elements of ``elem`` bytes on the wire."""
    if world == 1:
        return Traffic()
    chunk = -(-n // world)
    share = (world - 1) * chunk * elem
    # all_to_all: the other replicas' chunks leave and arrive; all_gather: own mean leaves, others arrive.
    return Traffic(sent=share + chunk * elem, received=2 * share)


def hsdp_allreduce_bytes(numel: int, replicas: int, elem: int) -> int:
    """Bytes one rank sends (= receives) per step in HSDP's ring all-reduce of ``numel`` gradient
    elements of ``elem`` bytes over ``replicas`` (modelled: torch's all-reduce reports none)."""
    return 2 * (replicas - 1) * numel * elem // replicas


class ExchangeTimer:
    """Times an exchange without a host sync: CUDA collectives are asynchronous, so on CUDA
    two stream events bracket it and the elapsed time is read only when asked for."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.start = time.perf_counter()

    def stop(self) -> "ExchangeTimer":
        if self.cuda:
            self.end.record()
        else:
            self.elapsed = time.perf_counter() - self.start
        return self

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1e3
        return self.elapsed
