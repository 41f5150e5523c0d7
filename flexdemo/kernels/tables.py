"""Grouped launches: one kernel launch for many tensors that share a block geometry.

The per-tensor launches are CPU-bound, so the grouped kernels run one program per block of
the whole group. Per-tensor data (addresses, columns, blocks per row, first block) lives in
small device tables, built once and cached: layout tables by the layouts, address tables by
the data_ptrs. A group's ``idx``/``vals`` are its tensors' ``[B_i, k]`` rows concatenated in
list order (:func:`group_block_offsets`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from flexdemo.kernels.common import HAVE_TRITON, check_tensor, fused_supported
from flexdemo.wire.dct import BlockLayout

if HAVE_TRITON:
    import triton
    import triton.language as tl

    # blk_tensor[g] (int32) is the tensor of group block g; meta[t] = (cols, blocks_per_row,
    # first group block, rows) (int64); ptrs[t] holds raw addresses (int64) that are cast to pointers.
    @triton.jit
    def group_locate(g, blk_tensor_ptr, meta_ptr, ALIGNED: tl.constexpr):
        t = tl.load(blk_tensor_ptr + g).to(tl.int64)
        C = tl.load(meta_ptr + t * 4).to(tl.int32)
        if ALIGNED:  # host-checked: every tensor's cols % 16 == 0 (lets loads vectorize, as per tensor)
            C = tl.multiple_of(C, 16)
        bpr = tl.load(meta_ptr + t * 4 + 1).to(tl.int32)
        b = (g - tl.load(meta_ptr + t * 4 + 2)).to(tl.int32)
        R = tl.load(meta_ptr + t * 4 + 3).to(tl.int32)
        return t, b, R, C, bpr


_TABLE_CACHE_SIZE = 256
_LAYOUT_TABLES: OrderedDict = OrderedDict()
_PTR_TABLES: OrderedDict = OrderedDict()


def group_key(layout: BlockLayout, k: int, encoding: str) -> tuple[int, int, int, str]:
    """Tensors with equal keys can share one grouped launch: ``(n1, n2, k, encoding)``.

    ``k`` must be the per-block top-k actually used (already clamped to ``block_numel``).
    The ``precision`` of a call is the same for the whole group by construction.
    """
    return (layout.n1, layout.n2, int(k), encoding)


def group_block_offsets(layouts: list[BlockLayout]) -> list[int]:
    """``offsets`` (length ``len(layouts) + 1``): tensor i's blocks are rows ``offsets[i]:offsets[i+1]``
    of the grouped ``idx``/``vals``."""
    out = [0]
    for L in layouts:
        out.append(out[-1] + L.num_blocks)
    return out


def _cache_get(cache: OrderedDict, key):
    v = cache.get(key)
    if v is not None:
        cache.move_to_end(key)
    return v


def _cache_put(cache: OrderedDict, key, value):
    cache[key] = value
    if len(cache) > _TABLE_CACHE_SIZE:
        cache.popitem(last=False)
    return value


def device_table(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        # Pinned + non_blocking: no host sync (the caching host allocator keeps the staging buffer
        # alive until the copy has run).
        return t.pin_memory().to(device, non_blocking=True)
    return t


def layout_tables(layouts: list[BlockLayout], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """(blk_tensor int32 [total_blocks], meta int64 [T, 4] = (cols, blocks_per_row, first block, rows), total,
    whether every cols % 16 == 0)."""
    key = (device, tuple((L.shape, L.n1, L.n2) for L in layouts))
    hit = _cache_get(_LAYOUT_TABLES, key)
    if hit is not None:
        return hit
    offsets = group_block_offsets(layouts)
    total = offsets[-1]
    if total >= 2**31:
        raise ValueError(f"fused grouped codec: {total} blocks in one group (max 2**31 - 1); split the group")
    meta = [(L.cols, L.col_blocks, offsets[i], L.rows) for i, L in enumerate(layouts)]
    counts = torch.tensor([L.num_blocks for L in layouts], dtype=torch.int64)
    blk_tensor = torch.repeat_interleave(torch.arange(len(layouts), dtype=torch.int32), counts, output_size=total)
    if device.type == "cuda":
        blk_tensor = blk_tensor.pin_memory().to(device, non_blocking=True)
    aligned = all(L.cols % 16 == 0 for L in layouts)
    return _cache_put(_LAYOUT_TABLES, key, (blk_tensor, device_table(meta, torch.int64, device), total, aligned))


def ptr_table(addrs: tuple, device: torch.device) -> tuple[torch.Tensor, bool]:
    """(int64 table of the addresses, whether all are 16-byte aligned)."""
    key = (device, addrs)
    hit = _cache_get(_PTR_TABLES, key)
    if hit is not None:
        return hit
    aligned = all(a % 16 == 0 for a in addrs)
    return _cache_put(_PTR_TABLES, key, (device_table(list(addrs), torch.int64, device), aligned))


def align_hints(cols_aligned: bool, ptrs_aligned: bool) -> bool:
    # The divisibility hints, where every column count and address allows them. Speed only: a
    # group without them (a misaligned tensor) gives the same bits (tests/test_fused_grouped.py),
    # so this is no config key (common.py, above search_bracket, says which launch choices are).
    return cols_aligned and ptrs_aligned


def lr_arg(lr, n: int, device: torch.device):
    """(scalar lr, lr table or None): a float is passed as a kernel scalar, a sequence as a fp32 table."""
    if isinstance(lr, (int, float)):
        return float(lr), None
    if isinstance(lr, torch.Tensor):
        t = lr.to(device=device, dtype=torch.float32).reshape(-1)
    else:
        t = device_table([float(x) for x in lr], torch.float32, device)
    if t.numel() != n:
        raise ValueError(f"fused grouped codec: {t.numel()} learning rates for {n} tensors")
    return 0.0, t.contiguous()


def check_group(tensors: list[torch.Tensor], layouts: list[BlockLayout], what: str) -> torch.device:
    if len(tensors) != len(layouts) or not tensors:
        raise ValueError(f"fused grouped codec: need one layout per {what} (and at least one), "
                         f"got {len(tensors)} tensors and {len(layouts)} layouts")
    device = tensors[0].device
    n1, n2 = layouts[0].n1, layouts[0].n2
    for t, L in zip(tensors, layouts):
        if L.n1 != n1 or L.n2 != n2:
            raise ValueError(f"fused grouped codec: blocks {L.n1}x{L.n2} in a group of {n1}x{n2} (see group_key)")
        if t.device != device:
            raise ValueError(f"fused grouped codec: {what} on {t.device} and {device} in one group")
        if not fused_supported(L, device, t.dtype):
            raise ValueError(f"fused grouped codec: unsupported layout {L} on {device}")
        check_tensor(t, L, what)
    return device
