"""How one exchange's payload is laid out: tensors bucketed by block geometry.

Tensors of one param group that share the block shape ``n1 x n2``, ``k`` and dtype form a
bucket (tensors whose blocks keep different k, a shard ending in partial blocks, form buckets
of their own, which carry each block's k: :class:`flexdemo.wire.format.BlockTopks`); a bucket's kept coefficients (its tensors' blocks in order) travel as ONE bit
stream ``[indices | values]``, byte-aligned per bucket. Buckets let the GPU path encode,
pack, unpack and decode many tensors per kernel launch, and keep the wire format the
same whichever path (torch or fused) a rank uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexdemo.wire.dct import BlockLayout, block_layout
from flexdemo.wire.format import BlockTopks, block_topks, blocks_nbytes


@dataclass
class Member:
    param: torch.Tensor
    layout: BlockLayout
    first_block: int  # row of this tensor's first block within the bucket
    per_block: BlockTopks | None = None  # each block's top-k where they differ, else None


@dataclass
class Bucket:
    group_index: int  # which param group (lr, decay, weight decay)
    n1: int
    n2: int
    k: int
    dtype: torch.dtype
    members: list[Member] = field(default_factory=list)
    num_blocks: int = 0
    byte_offset: int = 0  # where this bucket starts in the step's payload
    path: object = None  # set by the compressor: compression.paths' TorchPath or FusedPath
    index_coding: str = "fixed"  # how its indices travel (flexdemo.wire.format)
    per_block: BlockTopks | None = None  # ragged buckets: every block's own top-k (k is the largest)
    topk: int = 0  # the configured top-k per full block (chunk x chunk; chunk of a 1-D tensor), k scaled from it

    @property
    def ragged(self) -> bool:
        """Whether its blocks keep different k (partial edge blocks): the torch path's sub-streams."""
        return self.per_block is not None

    @property
    def fused(self) -> bool:
        """Whether this bucket takes the Triton kernels (its path is the fused one)."""
        return bool(getattr(self.path, "fused", False))

    @property
    def block_numel(self) -> int:
        return self.n1 * self.n2

    def nbytes(self, encoding: str) -> int:
        """Index bytes + value bytes: the payload formula for one bucket."""
        return blocks_nbytes(self.num_blocks, self.k, self.per_block, self.block_numel, encoding, self.index_coding)


def build_plan(
    local_shapes: list[list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]],
    chunks: list[int],
    topks: list[int],
    encoding: str,
    index_coding: str = "fixed",
    transform: str = "dct",
) -> tuple[list[Bucket], int]:
    """Buckets for ``local_shapes[g] = [(param, local shape, dtype), ...]`` per param group, each
    group cut into ``chunks[g]`` blocks keeping ``topks[g]`` per full block of its ``transform``
    (``chunk x chunk``, ``chunk`` elements of a 1-D tensor: :func:`flexdemo.wire.format.block_topks`;
    :class:`flexdemo.wire.dct.BlockLayout`).

    Tensors with no elements (empty FSDP shards) send nothing and are left out.
    Returns the buckets in payload order and the total payload bytes.
    """
    buckets: dict[tuple, Bucket] = {}
    for g, entries in enumerate(local_shapes):
        for param, shape, dtype in entries:
            layout = block_layout(shape, chunks[g], transform)
            if layout.num_blocks == 0:
                continue
            k, per_block = block_topks(layout, topks[g])
            key = (g, layout.n1, layout.n2, k, dtype, per_block is not None)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket(g, layout.n1, layout.n2, k, dtype, index_coding=index_coding,
                                               topk=int(topks[g]))
            bucket.members.append(Member(param, layout, bucket.num_blocks, per_block and BlockTopks(per_block)))
            bucket.num_blocks += layout.num_blocks
    offset = 0
    ordered = list(buckets.values())
    for bucket in ordered:
        if bucket.members[0].per_block is not None:
            bucket.per_block = BlockTopks(tuple(k for m in bucket.members for k in m.per_block.per_block))
        bucket.byte_offset = offset
        offset += bucket.nbytes(encoding)
    return ordered, offset


def describe_blocks(buckets: list[Bucket], encoding: str) -> str:
    """One line for the start-up log: per block shape and top-k, how many tensors and blocks
    (and how many tensors end in partial, zero-padded blocks), and the payload's bytes."""
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for b in buckets:  # a ragged bucket is named by its largest k
        tensors, blocks, partial = shapes.setdefault((b.n1, b.n2, b.k), [0, 0, 0])
        shapes[(b.n1, b.n2, b.k)] = [tensors + len(b.members), blocks + b.num_blocks,
                                     partial + sum(m.layout.padded for m in b.members)]
    parts = [f"{n1}x{n2} top-{k}: {t} tensors, {n:,} blocks" + (f" ({p} with partial edge blocks)" if p else "")
             for (n1, n2, k), (t, n, p) in shapes.items()]
    total = sum(b.nbytes(encoding) for b in buckets)
    coding = f", {buckets[0].index_coding} indices" if buckets and buckets[0].index_coding != "fixed" else ""
    kind = "DCT blocks" if not buckets or buckets[0].members[0].layout.transform == "dct" else "Blocks (no transform)"
    return f"{kind} per rank: {'; '.join(parts) or 'none'}; {total:,} payload bytes per exchange ({encoding}{coding})"
