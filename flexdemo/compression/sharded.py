"""The sharded exchange: per-rank bytes that do not grow with the number of replicas W.

The all_gather exchange hands every replica all W payloads: each rank receives (W - 1) x its
own payload per step. Here each bucket's DCT blocks are split among the replicas in contiguous
ranges (owner ``o`` holds blocks ``[o*B//W, (o+1)*B//W)``), and one exchange is two collectives:

1. **all_to_all**: every replica sends each owner its kept coefficients of that owner's blocks,
   packed in the payload format (top-k per block);
2. each owner unpacks what the W replicas sent it and forms, per coefficient, the mean over the
   replicas that voted for it: the mean the all_gather decode forms. Per block it keeps the
   ``sharded_topk`` coefficients with the largest summed vote (|sum of the replicas' values|:
   the coefficients most replicas pushed the same way; ties to the lower index) and packs their
   *means* (:func:`flexdemo.wire.format.means_encoding`: fp32 or bf16 as configured, bf16 for
   the 1-bit encodings), followed by its own flag byte;
3. **all_to_all** again: every owner sends its packed means to every replica (an all_gather of
   rows of slightly different lengths, unpadded), so all hold the same bits, and each replica
   decodes every block from one voter (its owner).

Each rank receives about (W-1)/W x (its payload + the means' payload) per step: flat in W.

What the re-compression drops is not lost: a coefficient a replica sent that its owner did not
apply (beyond ``sharded_topk`` per block, or a mean of exactly zero) goes back into that
replica's error feedback (:meth:`ShardedExchange.dropped`), as if never sent, and competes again
next exchange. What the means' encoding rounds (bf16) is not fed back. With fp32 values and
``sharded_topk >= W x topk`` nothing is dropped or rounded: the update and every replica's
error feedback equal the all_gather exchange's bit for bit.
"""

from __future__ import annotations

import torch

from flexdemo.compression.codec import pack_blocks, unpack_blocks, vote_totals
from flexdemo.compression.exchange import Traffic
from flexdemo.compression.buckets import Bucket
from flexdemo.wire.format import FLAG_BYTES, BlockTopks, blocks_nbytes, clamp_topk, means_encoding


def sharded_topks(bucket: Bucket, sharded_topk: int) -> tuple[int, BlockTopks | None]:
    """The means an owner keeps per block: each block's own top-k times ``sharded_topk / topk``
    (rounded half up, at least 1; 0: the block's top-k), so that ``sharded_topk >= W x topk``
    keeps whatever any of W replicas sent, small and partial blocks too."""
    if not sharded_topk or sharded_topk == bucket.topk:
        return bucket.k, bucket.per_block
    ks = bucket.per_block.per_block if bucket.per_block is not None else (bucket.k,)
    scaled = tuple(clamp_topk((2 * k * sharded_topk + bucket.topk) // (2 * bucket.topk), bucket.block_numel)
                   for k in ks)
    k2 = max(scaled)
    return k2, (BlockTopks(scaled) if bucket.per_block is not None and min(scaled) != k2 else None)


def _part(per_block: BlockTopks | None, start: int, stop: int) -> BlockTopks | None:
    return per_block.slice(start, stop) if per_block is not None else None


class ShardedExchange:
    """The byte layout and the two collectives of the sharded exchange for one compressor's
    buckets, on rank ``rank`` of a replica group of ``world`` ranks."""

    applies_all_sent = False  # owners keep sharded_topk per block: the rest goes back to error feedback

    def __init__(self, buckets: list[Bucket], encoding: str, sharded_topk: int, world: int, rank: int):
        self.buckets, self.encoding, self.world, self.rank = buckets, encoding, world, rank
        self.means_encoding = means_encoding(encoding)
        # Per bucket: the means kept per block, the owners' first blocks, and per owner the bytes
        # of the coefficients sent to it (stage 1) and of its packed means (stage 2).
        # Blocks of different k (partial edge blocks) keep them per owner range (``sent_k``,
        # ``mean_k``: None where a bucket's blocks share one k).
        kept = [sharded_topks(b, sharded_topk) for b in buckets]
        self.k2 = [k2 for k2, _ in kept]
        self.starts = [[o * b.num_blocks // world for o in range(world + 1)] for b in buckets]
        self.sent_k = [[_part(b.per_block, s[o], s[o + 1]) for o in range(world)] for b, s in zip(buckets, self.starts)]
        self.mean_k = [[_part(per, s[o], s[o + 1]) for o in range(world)] for (_, per), s in zip(kept, self.starts)]
        self.sent_bytes = [[blocks_nbytes(s[o + 1] - s[o], b.k, self.sent_k[i][o], b.block_numel, encoding,
                                          b.index_coding) for o in range(world)]
                           for i, (b, s) in enumerate(zip(buckets, self.starts))]
        self.mean_bytes = [[blocks_nbytes(s[o + 1] - s[o], k2, self.mean_k[i][o], b.block_numel, self.means_encoding,
                                          b.index_coding) for o in range(world)]
                           for i, (b, s, k2) in enumerate(zip(buckets, self.starts, self.k2))]
        # Stage 1, owner-major: owner o's part is every bucket's coefficients of o's blocks.
        # Stage 2: owner o's row is every bucket's means of o's blocks, then o's own flag byte
        # (a replica that saw a non-finite value sent finite coefficients without that gradient in
        # stage 1; its flag tells every replica to skip the update).
        self.part_bytes = [sum(sb[o] for sb in self.sent_bytes) for o in range(world)]
        self.row_bytes = [sum(mb[o] for mb in self.mean_bytes) + FLAG_BYTES for o in range(world)]
        self.row_starts = [sum(self.row_bytes[:o]) for o in range(world + 1)]
        # Where bucket i starts within owner o's part (stage 1) and within the rows (stage 2).
        self.sent_at = [[sum(self.sent_bytes[j][o] for j in range(i)) for o in range(world)]
                        for i in range(len(buckets))]
        self.mean_at = [[self.row_starts[o] + sum(self.mean_bytes[j][o] for j in range(i)) for o in range(world)]
                        for i in range(len(buckets))]
        self._flag_index: dict[torch.device, torch.Tensor] = {}  # the rows' last bytes, per device

    @property
    def payload_nbytes(self) -> int:
        """Bytes this rank packs per exchange: every owner's part, and its flag byte."""
        return sum(self.part_bytes) + FLAG_BYTES

    def traffic(self) -> Traffic:
        """This rank's bytes per exchange: its parts for the other owners and its row, out; the
        others' parts for its blocks and their rows, in."""
        me, W = self.rank, self.world
        others_rows = self.row_starts[W] - self.row_bytes[me]
        return Traffic(sent=sum(self.part_bytes) - self.part_bytes[me] + (W - 1) * self.row_bytes[me],
                       received=(W - 1) * self.part_bytes[me] + others_rows)

    def k_decoded(self, i: int) -> int:
        """Coefficients per block the decode reads for bucket ``i`` (the owners' means)."""
        return self.k2[i]

    def pack(self, i: int, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """Bucket ``i``'s kept coefficients ``[B, k]`` -> one bit stream per owner's block range,
        concatenated in owner order."""
        b, s = self.buckets[i], self.starts[i]
        return torch.cat([pack_blocks(idx[s[o]:s[o + 1]], vals[s[o]:s[o + 1]], self.sent_k[i][o], b.block_numel,
                                      self.encoding, b.index_coding) for o in range(self.world)])

    def exchange(self, payloads: list[torch.Tensor], flag: torch.Tensor, group, timeout: float | None,
                 device: torch.device) -> tuple[torch.Tensor, Traffic]:
        """``payloads``: :meth:`pack`'s bytes of every bucket. Returns every owner's row, end to
        end (the same bits on every rank), and this rank's traffic."""
        W, me = self.world, self.rank
        # Stage 1: the bucket-major bytes regrouped owner-major; each owner gets its part.
        offsets = [0] * len(payloads)
        parts = []
        for o in range(W):
            for i, p in enumerate(payloads):
                parts.append(p[offsets[i]:offsets[i] + self.sent_bytes[i][o]])
                offsets[i] += self.sent_bytes[i][o]
        send = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
        recv = torch.empty(W * self.part_bytes[me], dtype=torch.uint8, device=device)
        group.all_to_all(recv, send, [self.part_bytes[me]] * W, self.part_bytes, timeout=timeout,
                         what="the sharded exchange (to the owners)")
        received = recv.view(W, self.part_bytes[me])
        # Owner: the mean of every coefficient of my blocks, re-compressed; my flag last.
        row = torch.empty(self.row_bytes[me], dtype=torch.uint8, device=device)
        for i, b in enumerate(self.buckets):
            n = self.starts[i][me + 1] - self.starts[i][me]
            if n:
                sent_at, mean_at = self.sent_at[i][me], self.mean_at[i][me] - self.row_starts[me]
                seg = received[:, sent_at:sent_at + self.sent_bytes[i][me]]
                idx, vals = b.path.unpack(seg, n, b.k, b.block_numel, b.dtype, self.sent_k[i][me])
                mean_k = self.mean_k[i][me]
                means = self.owner_means(idx, vals, b.block_numel, self.k2[i],
                                         None if mean_k is None else mean_k.per_block_on(device))
                row[mean_at:mean_at + self.mean_bytes[i][me]] = pack_blocks(*means, mean_k, b.block_numel,
                                                                            self.means_encoding, b.index_coding)
        row[-FLAG_BYTES:] = flag.reshape(FLAG_BYTES)
        # Stage 2: my row to every replica, every owner's row to me (rows differ in length by
        # a block or so per bucket: an all_to_all sends each exactly, an all_gather would pad).
        rows = torch.empty(self.row_starts[W], dtype=torch.uint8, device=device)
        group.all_to_all(rows, row.repeat(W), self.row_bytes, [self.row_bytes[me]] * W, timeout=timeout,
                         what="the sharded exchange (from the owners)")
        return rows, self.traffic()

    def start(self, payloads, flag, group):
        raise ValueError("the sharded exchange runs two collectives with the owners' work between them: "
                         "it cannot be started and left in flight (overlap needs exchange = \"allgather\")")

    def owner_means(self, idx: torch.Tensor, vals: torch.Tensor, block_numel: int,
                    k2: int, row_k2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """W replicas' ``[W, n, k]`` coefficients of n blocks -> per block the ``k2`` coefficients
        (``row_k2``: each block's own, the slots beyond it zero) with the largest |sum of votes|
        (ties: the lower index), as ``(idx, mean over their voters)`` ``[n, k2]``."""
        total, count = vote_totals(idx, vals, block_numel)
        # Ties (1-bit votes sum to integers) go to the lower index: a stable sort, not topk, whose
        # order among equals is unspecified (the owner alone decides, but runs must repeat).
        keep = torch.sort(total.abs(), dim=-1, descending=True, stable=True).indices[:, :k2]
        means = torch.gather(total, -1, keep) / torch.gather(count, -1, keep).clamp_min(1)
        if row_k2 is not None:
            means = torch.where(torch.arange(k2, device=means.device) < row_k2.unsqueeze(-1), means, 0.0)
        return keep, means

    def flag_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        """Every replica's flag byte, in rank order: the last byte of its row."""
        if rows.device not in self._flag_index:  # built once: no host-to-device copy per step
            self._flag_index[rows.device] = torch.tensor(self.row_starts[1:], device=rows.device) - FLAG_BYTES
        return rows[self._flag_index[rows.device]]

    def unpack(self, i: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``i``'s means from every owner's row: ``(idx, vals)`` ``[1, B, k2]``, one voter
        (index -1, value 0 where a slot carries no non-zero mean)."""
        b, s = self.buckets[i], self.starts[i]
        idx_parts, val_parts = [], []
        for o in range(self.world):
            n = s[o + 1] - s[o]
            if not n:
                continue
            at = self.mean_at[i][o]
            seg = rows[at:at + self.mean_bytes[i][o]].unsqueeze(0)
            idx, vals = unpack_blocks(seg, n, self.k2[i], self.mean_k[i][o], b.block_numel, self.means_encoding,
                                      b.dtype, b.index_coding)
            idx_parts.append(idx)
            val_parts.append(vals)
        return torch.cat(idx_parts, dim=1), torch.cat(val_parts, dim=1)

    def dropped(self, i: int, means_idx: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """What this replica sent of bucket ``i`` (``idx``/``vals`` ``[B, k]``, as selected) that no
        owner applied: ``vals`` with every coefficient the owners' means carry (``means_idx``, from
        :meth:`unpack`) set to zero. Put back into the error feedback, it is as if never sent."""
        b = self.buckets[i]
        applied = means_idx.reshape(b.num_blocks, -1)
        # Count, not scatter a bool: the -1 slots clamp to column 0, where a 0 written after a 1 would win.
        dense = torch.zeros(b.num_blocks, b.block_numel, dtype=torch.int32, device=idx.device)
        dense.scatter_add_(1, applied.long().clamp_min(0), (applied >= 0).to(torch.int32))
        return torch.where(dense.gather(1, idx.long()) > 0, 0.0, vals).to(vals.dtype)
