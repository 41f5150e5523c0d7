"""The all_gather exchange: every replica receives every replica's payload and decodes the mean.

One of the two exchange strategies (the other: :mod:`flexdemo.compression.sharded`); both have
the same small interface, and the compressor picks one once, per replica count and rank:

* ``payload_nbytes``: bytes this rank packs per exchange (its flag byte included);
* ``pack(i, idx, vals)``: bucket ``i``'s kept coefficients as this strategy sends them;
* ``exchange(payloads, flag, group, timeout, device) -> (rows, traffic)``: the collective(s);
* ``start(...)``: the same, left in flight (all_gather only: one collective can be);
* ``flag_bytes(rows)``, ``unpack(i, rows)``: every replica's flag byte; bucket ``i``'s ``(idx, vals)``;
* ``dropped(i, ...)``: what this replica sent that was not applied (None: everything was, which
  ``applies_all_sent`` says up front);
* ``k_decoded(i)``: coefficients per block the decode reads.

Here a payload is every bucket's bit stream end to end, then the flag byte; one all_gather hands
each rank ``[replicas, nbytes]``, and each rank receives (W - 1) payloads per step.
"""

from __future__ import annotations

import torch

from flexdemo.compression.exchange import Traffic, gather_payloads
from flexdemo.compression.buckets import Bucket
from flexdemo.wire.format import FLAG_BYTES


class AllGatherExchange:
    applies_all_sent = True  # every coefficient a replica sends is applied: nothing to feed back

    def __init__(self, buckets: list[Bucket], encoding: str, world: int, rank: int):
        self.buckets, self.encoding, self.world, self.rank = buckets, encoding, world, rank
        self.payload_nbytes = sum(b.nbytes(encoding) for b in buckets) + FLAG_BYTES

    def traffic(self) -> Traffic:
        """This rank's bytes per exchange: its payload out, the other replicas' in."""
        return Traffic(sent=self.payload_nbytes, received=(self.world - 1) * self.payload_nbytes)

    def k_decoded(self, i: int) -> int:
        return self.buckets[i].k

    def pack(self, i: int, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        b = self.buckets[i]
        return b.path.pack(idx, vals, b.block_numel, b.per_block)

    def concat(self, payloads: list[torch.Tensor], flag: torch.Tensor) -> torch.Tensor:
        mine = torch.cat([*payloads, flag.reshape(FLAG_BYTES)])
        if mine.numel() != self.payload_nbytes:
            raise RuntimeError(f"payload of {mine.numel()} bytes, the plan says {self.payload_nbytes}")
        return mine

    def exchange(self, payloads, flag, group, timeout, device) -> tuple[torch.Tensor, Traffic]:
        gathered, traffic, _ = gather_payloads(self.concat(payloads, flag), group, timeout=timeout)
        return gathered, traffic

    def start(self, payloads, flag, group):
        """The all_gather started and not waited for: ``(mine, gathered, traffic, work)``."""
        mine = self.concat(payloads, flag)
        gathered, traffic, work = gather_payloads(mine, group, async_op=True)
        return mine, gathered, traffic, work

    def flag_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, -FLAG_BYTES]

    def unpack(self, i: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.buckets[i]
        payloads = rows[:, b.byte_offset:b.byte_offset + b.nbytes(self.encoding)]
        return b.path.unpack(payloads, b.num_blocks, b.k, b.block_numel, b.dtype, b.per_block)

    def dropped(self, i: int, decoded_idx, idx, vals) -> None:
        return None  # every coefficient sent is applied
