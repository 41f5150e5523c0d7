"""The replicas' start-up agreement: every setting that changes the bits a replica decodes.

Replicas stay bit-identical only if each one turns the same gathered bytes into the same
update. So before the first exchange every rank builds an ordered list of named settings (the
payload format version, value encoding, each parameter's blocks and top-k, the decode path,
kernel precision, the installed torch/Triton and the GPU, and its caller's own settings, such as
DiLoCo's outer SGD) and the replica group compares them:

1. one all_gather of ``[count, digest]`` over the replica group (the common case: all agree);
2. only on a mismatch, ``all_gather_object`` of the settings themselves, to name the first
   setting that differs, both values and both ranks, in one line;
3. the verdict is agreed over the whole world (one all-reduce of a flag), so every rank raises
   the same :class:`ReplicaSettingsMismatch`, also ranks whose own replica group agreed: the
   launcher shows rank 0's output, and no rank is left waiting in a later collective.

What it cannot see (a BLAS library's choice of kernels by CPU ISA or SM count, say) is left to
the periodic bit-identity check (``replica_check_interval``).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from flexdemo.compression.exchange import distributed
from flexdemo.local import describe_layout
from flexdemo.replica_group import replica_group
from flexdemo.wire import format as wire_format

ABSENT = "nothing (the setting is missing there)"


class ReplicaSettingsMismatch(ValueError):
    """Replicas would decode the exchange differently: raised on every rank alike, at start."""

    def __init__(self, who: str, setting: str, ranks: tuple[int, int], values: tuple[str, str]):
        self.setting, self.ranks, self.values = setting, ranks, values
        super().__init__(
            f"{who}: replicas disagree on {setting}: rank {ranks[0]} has {values[0]!r}, rank {ranks[1]} has "
            f"{values[1]!r}; every replica must run the same install and settings, or their updates drift apart"
        )


def _digest(items: list[tuple[str, str]]) -> int:
    text = "\n".join(f"{k}={v}" for k, v in items)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")  # fits an int64


def first_difference(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> tuple[str, str, str] | None:
    """``(setting, value in a, value in b)`` of the first setting (in ``a``'s order, then ``b``'s)
    whose values differ, or None."""
    da, db = dict(a), dict(b)
    for key in [k for k, _ in a] + [k for k, _ in b if k not in da]:
        if da.get(key, ABSENT) != db.get(key, ABSENT):
            return key, da.get(key, ABSENT), db.get(key, ABSENT)
    return None


def check_settings_agree(who: str, settings: dict[str, object], group, device: torch.device,
                         world_group=None) -> None:
    """Raise :class:`ReplicaSettingsMismatch` on every rank of ``world_group`` (default: the
    world) unless every replica group's ranks hold the same ``settings``. Every rank of
    ``world_group`` must call it, once, at start (it runs collectives)."""
    if not distributed():
        return
    group = replica_group(group)
    items = [("optimizer", who)] + [(k, str(v)) for k, v in settings.items()]
    mine = torch.tensor([len(items), _digest(items)], dtype=torch.int64, device=device)
    world = group.size()
    gathered = torch.empty(world, 2, dtype=torch.int64, device=device)
    group.all_gather(gathered, mine, what="the settings check")
    rows = gathered.tolist()
    message = None
    if any(row != rows[0] for row in rows):
        everyone = group.gather_objects(items)
        ranks = group.global_ranks()
        for r in range(1, world):
            diff = first_difference(everyone[0], everyone[r])
            if diff is not None:
                message = (who, diff[0], (ranks[0], ranks[r]), diff[1:])
                break
    # One verdict for the whole world: the first rank's message (in rank order) that has one.
    flag = torch.tensor([int(message is not None)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world_group)
    if not flag.item():
        return
    messages: list = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(messages, message, group=world_group)
    first = next(m for m in messages if m is not None)
    raise ReplicaSettingsMismatch(first[0], first[1], first[2], first[3])


def _environment(any_fused: bool, device: torch.device) -> dict[str, str]:
    """What the install contributes to the decoded bits."""
    env = {"torch version": torch.__version__}
    if any_fused:
        try:
            import triton

            env["Triton version"] = triton.__version__
        except Exception:  # pragma: no cover - a fused bucket implies Triton imported
            env["Triton version"] = "none"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        env["GPU architecture"] = f"sm_{major}{minor}"
    env["float32 matmul precision"] = torch.get_float32_matmul_precision()  # the torch path's DCTs
    return env


def compressor_settings(buckets, entries, encoding: str, kernel_precision: str,
                        device: torch.device) -> dict[str, str]:
    """The settings of a :class:`~flexdemo.compression.compressor.TopkCompressor`: ``buckets``
    from :func:`~flexdemo.compression.buckets.build_plan` (``fused`` set), ``entries[g]`` =
    ``[(param, local shape, dtype), ...]`` per param group, as the plan was built from.
    Each parameter is described by its layout as the plan reports it (blocks, their edges, k),
    not by re-deriving the block rule."""
    planned = {id(m.param): (m.layout, b.k, m.per_block) for b in buckets for m in b.members}
    settings = {
        "payload format version": str(wire_format.WIRE_FORMAT_VERSION),  # read now: tests patch it
        "value encoding": encoding,
        "parameter count": f"{sum(len(es) for es in entries)} in {len(entries)} param group(s)",
    }
    index = 0
    for g, es in enumerate(entries):
        for param, shape, dtype in es:
            group = f" in group {g}" if len(entries) > 1 else ""
            where = f"local shape {tuple(shape)} {str(dtype).removeprefix('torch.')}{describe_layout(param)}{group}"
            if id(param) in planned:
                layout, k, per_block = planned[id(param)]
                plural = "s" if layout.num_blocks != 1 else ""
                where += f": {layout.num_blocks} block{plural} of {layout.n1}x{layout.n2}, top-{k}"
                if per_block is not None:
                    where += f" (partial blocks top-{'/'.join(map(str, sorted(set(per_block.per_block) - {k})))})"
            else:
                where += ": sends nothing"
            settings[f"parameter {index}"] = where
            index += 1
    settings["decode path"] = _decode_path([b.fused for b in buckets])
    settings["kernel precision"] = kernel_precision
    settings.update(_environment(any(b.fused for b in buckets), device))
    return settings


def _decode_path(fused: list[bool]) -> str:
    if all(fused):
        return "fused (Triton kernels)" if fused else "none (nothing to send)"
    if not any(fused):
        return "torch"
    on = [i for i, f in enumerate(fused) if f]
    off = [i for i, f in enumerate(fused) if not f]
    return f"fused for buckets {on}, torch for buckets {off}"


def dense_settings(params) -> dict[str, str]:
    """DiLoCo's dense mean: each local shard's shape and dtype (the caller adds its wire dtype)."""
    from flexdemo.local import local_tensor

    settings = {"parameter count": str(len(params))}
    for i, p in enumerate(params):
        settings[f"parameter {i}"] = (f"local shape {tuple(local_tensor(p).shape)} "
                                      f"{str(p.dtype).removeprefix('torch.')}{describe_layout(p)}")
    return settings


def diloco_settings(compression: str, value_encoding: str, sync_interval: int, outer_lr: float,
                    outer_momentum: float, nesterov: bool) -> dict[str, str]:
    """DiLoCo's own: when replicas meet (a different H would pair different collectives) and the
    outer SGD that every replica applies to the same received bytes."""
    return {
        "outer exchange": compression,
        "outer value encoding": value_encoding,
        "sync interval": str(sync_interval),
        "outer lr": repr(float(outer_lr)),
        "outer momentum": repr(float(outer_momentum)),
        "outer nesterov": str(bool(nesterov)),
    }
