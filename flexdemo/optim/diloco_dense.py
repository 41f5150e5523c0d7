"""DiLoCo's dense outer exchange (``compression = "dense"``): the mean over the replicas of the
pseudo-gradient ``global - local``, in buckets of at most DENSE_BUCKET_ELEMENTS, with one more
element in the first bucket: the replica's non-finite flag (any replica's flag skips the step).

Over a fixed replica group each bucket's mean is applied as it arrives. Over an elastic group
(torchft) the means are kept until torchft says the step may be applied, so an exchange that
fails part-way leaves every parameter untouched (a transient copy of the pseudo-gradient)."""

from __future__ import annotations

from typing import Callable

import torch

from flexdemo.compression.exchange import ExchangeTimer, Traffic, replica_mean
from flexdemo.local import local_tensor
from flexdemo.optim.bounded_groups import bounded_groups
from flexdemo.optim.diloco_outer import Entry

DENSE_BUCKET_ELEMENTS = 1 << 26  # 256 MiB of fp32 pseudo-gradient per dense exchange


def dense_outer_exchange(
    entries: list[Entry], bad: bool, on_device: Callable, apply: Callable, group, wire: torch.dtype,
    timeout: float | None,
) -> tuple[Traffic, bool | None, list[ExchangeTimer]]:
    """Exchange every bucket and ``apply(bucket, mean)``: ``(traffic, skip, timers)`` with skip
    True (a replica flagged: nothing applied), False (applied), or None (elastic, not committed:
    nothing applied). ``on_device(state, like)``: a state tensor where ``like`` lives."""
    traffic, timers = Traffic(), []
    # A fixed group's exchange that returned is committed: apply each bucket's mean as it comes
    # (no second copy of the parameters). A torchft group commits after the last collective.
    hold = not group.membership_fixed
    means, skip = [], False
    for i, bucket in enumerate(dense_buckets(entries)):
        device = local_tensor(bucket[0].param).device
        flagged = i == 0  # the first bucket carries one more element: this replica's flag
        flat = torch.empty(sum(local_tensor(e.param).numel() for e in bucket) + flagged, device=device)
        offset = 0
        for e in bucket:
            local = local_tensor(e.param)
            out = flat[offset : offset + local.numel()].view(local.shape)
            if bad:
                out.zero_()  # nothing non-finite leaves this replica
            else:
                torch.sub(on_device(e.global_copy, local), local, out=out)
            offset += local.numel()
        if flagged:
            flat[-1] = float(bad)
        timer = ExchangeTimer(device)
        mean, t = replica_mean(flat, group, wire, timeout)
        timers.append(timer.stop())
        traffic = traffic + t
        if flagged and mean[-1].item() > 0:  # some replica flagged: all skip, and send nothing more
            skip = True
            break
        if hold:
            means.append((bucket, mean))
        else:
            apply(bucket, mean)
    if hold and not group.commit():
        return traffic, None, timers
    for bucket, mean in [] if skip else means:
        apply(bucket, mean)
    return traffic, skip, timers


def dense_buckets(entries: list[Entry]) -> list[list[Entry]]:
    """Consecutive entries of one device, at most DENSE_BUCKET_ELEMENTS each (a larger tensor
    alone), so the dense exchange needs a bounded flat buffer. Empty shards are skipped."""
    nonempty = [e for e in entries if local_tensor(e.param).numel()]
    groups = bounded_groups([local_tensor(e.param).numel() for e in nonempty], DENSE_BUCKET_ELEMENTS)
    return [[nonempty[i] for i in group] for group in groups]
