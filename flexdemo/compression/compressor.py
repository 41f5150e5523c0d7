"""The one compression path: chunked-DCT top-k with error feedback, and its packed exchange.

Both users call it: per-step DeMo (the accumulator is the momentum, the increment the
gradient, the decode a sign update of the parameters) and the DiLoCo outer step (the
accumulator is the error-feedback buffer, the increment the pseudo-gradient, the decode a
dense outer gradient). Per exchange:

1. :meth:`TopkCompressor.select` / :meth:`encode`: ``acc = decay * acc + scale * inc``; top-k
   of each DCT block of ``acc``; ``acc -= IDCT(sent)``; the kept ``(idx, vals)`` packed per
   bucket (:mod:`flexdemo.compression.buckets`, :mod:`flexdemo.compression.codec`);
2. :meth:`exchange`: the exchange strategy chosen once (:mod:`.allgather`: ONE all_gather of
   every bucket's bytes; :mod:`.sharded`: two all_to_alls through the blocks' owners) over the
   replica group (:mod:`flexdemo.replica_group`);
3. :meth:`unpack` + :meth:`decode_sign_update` / :meth:`decode_into`: the mean over the
   replicas that selected each coefficient, inverse DCT; :meth:`dropped` + :meth:`restore` put
   back into error feedback what the exchange did not apply (the sharded owners' leftovers).

Each replica's payload ends with one flag byte (:meth:`flags`): a replica that saw a
non-finite value says so there, so every replica learns it from the exchange itself and all
skip (or stop) alike; :meth:`restore` puts back into an accumulator what error feedback took
out for a payload that was not used.

Each bucket has a path (:mod:`flexdemo.compression.paths`): the fused Triton kernels when all
its tensors fit them (CUDA, fp32, >= 1-D, blocks <= 64x64), otherwise torch ops. Both give the
same wire format. ``transform="none"`` (SparseLoCo's rule) keeps the same blocks but top-k's
their raw values: no DCT, and the torch path (the kernels are DCT kernels).
"""

from __future__ import annotations

import time
from typing import Literal, get_args

import torch

from flexdemo.compression.agreement import check_settings_agree, compressor_settings
from flexdemo.compression.codec import sent_values
from flexdemo.compression.allgather import AllGatherExchange
from flexdemo.compression.exchange import ExchangeTimer, Traffic, distributed
from flexdemo.compression.paths import choose_path
from flexdemo.compression.buckets import Bucket, build_plan
from flexdemo.compression.sharded import ShardedExchange, sharded_topks
from flexdemo.replica_group import replica_group
from flexdemo.local import local_tensor
from flexdemo.wire.dct import TRANSFORMS, blocks_idct
from flexdemo.wire.format import FLAG_BYTES, check_encoding, check_index_coding

KernelPrecision = Literal["ieee", "tf32x3"]
KERNEL_PRECISIONS: tuple[str, ...] = get_args(KernelPrecision)
Exchange = Literal["allgather", "sharded"]
EXCHANGES: tuple[str, ...] = get_args(Exchange)


class StartedExchange:
    """An all_gather in flight. ``result()`` waits for it (once, at most ``timeout`` s) and
    returns the gathered ``[replicas, nbytes]``; ``waited_seconds`` is how long the caller was
    held up (host time)."""

    def __init__(self, gathered: torch.Tensor, work, group=None, timeout: float | None = None,
                 sent_row: torch.Tensor | None = None):
        self.gathered, self._work, self.waited_seconds = gathered, work, 0.0
        self.sent_row = sent_row  # this rank's own bytes in the exchange (its row of ``gathered``)
        self._group, self._timeout = group, timeout
        self.flags: HostFlags | None = None  # the flag bytes' copy to the host, if started early

    def result(self) -> torch.Tensor:
        if self._work is not None:
            start = time.perf_counter()
            self._group.wait(self._work, self._timeout, "the compressed exchange")
            self.waited_seconds = time.perf_counter() - start
            self._work = None
        return self.gathered


_FLAG_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _flag_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _FLAG_STREAMS:
        _FLAG_STREAMS[device] = torch.cuda.Stream(device)
    return _FLAG_STREAMS[device]


class HostFlags:
    """Every replica's flag byte on its way to the host: on CUDA a copy into pinned memory after
    the exchange on the stream, so that reading it (:meth:`values`) later waits only for that
    copy, not for the work queued after it (a ``tolist()`` would)."""

    def __init__(self, column: torch.Tensor, work=None):
        """``column``: every replica's flag byte (:meth:`TopkCompressor.flag_bytes`). ``work``:
        the all_gather still in flight (CUDA): the copy then runs on a side stream that waits for
        the collective only, not for what the compute stream queues meanwhile."""
        self._event = None
        if not column.is_cuda:
            self._host = column.clone()
            return
        self._host = torch.empty(column.shape, dtype=column.dtype, pin_memory=True)
        self._event = torch.cuda.Event()
        if work is None:
            self._host.copy_(column, non_blocking=True)
            self._event.record()
            return
        side = _flag_stream(column.device)
        side.wait_stream(torch.cuda.current_stream(column.device))  # the payload's own writes
        with torch.cuda.stream(side):
            work.wait()  # NCCL: this stream waits for the collective (the host does not)
            self._host.copy_(column, non_blocking=True)
            self._event.record(side)
        column.record_stream(side)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def values(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class TopkCompressor:
    """Compression of a fixed set of tensors (one list per param group, with its chunk and
    top-k), exchanged over ``replicate_group``. Every replica rank must build it for the same
    local layout and decode alike: that, and the caller's own ``agree`` settings, is checked once
    here, with one small all_gather (:mod:`flexdemo.compression.agreement`)."""

    def __init__(
        self,
        groups: list[list[torch.Tensor]],
        chunks: list[int],
        topks: list[int],
        encoding: str,
        replicate_group,
        *,
        fused: bool = True,
        kernel_precision: str = "tf32x3",
        timeout: float | None = None,
        who: str = "compression",
        agree: dict[str, str] | None = None,
        exchange: str = "allgather",
        sharded_topk: int = 0,
        index_coding: str = "fixed",
        transform: str = "dct",
    ):
        check_encoding(encoding)
        if transform not in TRANSFORMS:
            raise ValueError(f"{who}: transform must be one of {TRANSFORMS}, got {transform!r}")
        check_index_coding(index_coding)
        if exchange not in EXCHANGES:
            raise ValueError(f"{who}: exchange must be one of {EXCHANGES}, got {exchange!r}")
        if not isinstance(sharded_topk, int) or isinstance(sharded_topk, bool) or sharded_topk < 0:
            raise ValueError(f"{who}: sharded_topk must be an int >= 0 (0: the top-k), got {sharded_topk!r}")
        if kernel_precision not in KERNEL_PRECISIONS:
            raise ValueError(f"{who}: kernel_precision must be one of {KERNEL_PRECISIONS}, got {kernel_precision!r}")
        # tl.dot precision of the fused kernels' DCTs: "tf32x3" (three TF32 tensor-core products,
        # fp32-level agreement with the torch path) or "ieee" (fp32 on the CUDA cores, slower).
        self.kernel_precision = kernel_precision
        self.timeout = timeout  # seconds an exchange may take (None: the process group's timeout)
        self.encoding = encoding
        self.group = replica_group(replicate_group)
        entries = [[(t, tuple(local_tensor(t).shape), t.dtype) for t in ts] for ts in groups]
        self.buckets, _ = build_plan(entries, chunks, topks, encoding, index_coding, transform)
        self._index = {id(b): i for i, b in enumerate(self.buckets)}
        # The exchange strategy, chosen once: its byte layout depends on the replica count and this
        # rank's place, which a torchft group may change between steps, so a layout is made per
        # (count, rank) when first met (:attr:`strategy`). One replica: nothing to shard.
        sharded = exchange == "sharded"
        self._make_strategy = (
            lambda world, rank: ShardedExchange(self.buckets, encoding, sharded_topk, world, rank)
            if sharded and world > 1 else AllGatherExchange(self.buckets, encoding, world, rank))
        self._strategies: dict[tuple[int, int], object] = {}
        for b in self.buckets:
            # the decode reads the owners' sharded_topk means per block in the sharded exchange
            k_read = max(b.k, sharded_topks(b, sharded_topk)[0]) if sharded else b.k
            b.path = choose_path(b, fused, encoding, kernel_precision, k_read)
        flat = [t for ts in groups for t in ts]
        self.device = local_tensor(flat[0]).device if flat else torch.device("cpu")
        self.last_traffic = Traffic()
        self._timer: ExchangeTimer | None = None
        # The caller's settings (``agree``) and everything that changes the decoded bits, compared
        # over the group as it is now (a torchft group before its first quorum is this replica
        # alone: a joining replica is compared at join, against the same list: :attr:`settings`).
        self.settings = compressor_settings(self.buckets, entries, encoding, kernel_precision, self.device)
        self.settings["exchange"] = exchange if exchange == "allgather" else f"sharded, sharded_topk {sharded_topk}"
        self.settings["index coding"] = index_coding
        self.settings["transform"] = transform
        self.settings = {**(agree or {}), **self.settings}
        if distributed():
            check_settings_agree(who, self.settings, self.group, self.device)

    @property
    def strategy(self):
        """The exchange strategy's layout for this step's replicas (:mod:`.allgather`, :mod:`.sharded`)."""
        key = (self.group.size(), self.group.rank())
        if key not in self._strategies:
            self._strategies[key] = self._make_strategy(*key)
        return self._strategies[key]

    @property
    def sharded(self) -> ShardedExchange | None:
        """The sharded exchange's layout for this step's replicas, or None (all_gather)."""
        strategy = self.strategy
        return strategy if isinstance(strategy, ShardedExchange) else None

    @property
    def nbytes(self) -> int:
        """Bytes this rank packs per exchange."""
        return self.strategy.payload_nbytes

    def commit(self) -> bool:
        """Whether the last exchange's update may be applied (the replica group says: a torchft
        group answers whether every replica's part of the step succeeded)."""
        return self.group.commit()

    @property
    def uses_fused_kernels(self) -> bool:
        return any(b.fused for b in self.buckets)

    # -- encode -----------------------------------------------------------------------------

    def select(
        self,
        bucket: Bucket,
        accs: list[torch.Tensor],
        incs: list[torch.Tensor | None] | None = None,
        scale: float = 1.0,
        decay: float = 1.0,
        members: list[int] | None = None,
        skip_incs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``acc = decay * acc + scale * inc`` (``inc`` None = zero), top-k, error feedback, for
        the local accumulators ``accs`` of ``bucket``'s members (all, or the listed ``members``
        when the caller streams its state). Returns their ``(idx, vals)`` rows ``[B, k]``.
        ``skip_incs``: a one-element fp32 device tensor; nonzero: every ``inc`` counts as zero
        (decided on the device, without a host sync)."""
        chosen = [bucket.members[i] for i in members] if members is not None else bucket.members
        if len(accs) != len(chosen):
            raise ValueError(f"select: {len(accs)} accumulators for {len(chosen)} members")
        incs = incs if incs is not None else [None] * len(accs)
        row_ks = [m.per_block.per_block_on(self.device) for m in chosen] if bucket.ragged else None
        return bucket.path.encode(accs, incs, scale, decay, [m.layout for m in chosen], bucket.k, skip_incs, row_ks)

    def pack(self, bucket: Bucket, idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """A bucket's kept coefficients (all its members, in order) -> its bytes of the payload."""
        return self.strategy.pack(self._index[id(bucket)], idx, vals)

    def encode(self, bucket: Bucket, accs, incs=None, scale: float = 1.0, decay: float = 1.0) -> torch.Tensor:
        return self.pack(bucket, *self.select(bucket, accs, incs, scale, decay))

    # -- exchange ---------------------------------------------------------------------------

    def _flag(self, flag: torch.Tensor | None) -> torch.Tensor:
        if flag is None:
            return torch.zeros(FLAG_BYTES, dtype=torch.uint8, device=self.device)
        return flag.to(device=self.device, dtype=torch.uint8)

    def exchange(self, payloads: list[torch.Tensor], flag: torch.Tensor | None = None) -> torch.Tensor:
        """Every bucket's payload and this rank's flag (a 0/1 byte, zero if None) through the
        exchange strategy: the rows every rank decodes (all_gather: ``[replicas, nbytes]``)."""
        timer = ExchangeTimer(self.device)
        rows, self.last_traffic = self.strategy.exchange(payloads, self._flag(flag), self.group, self.timeout,
                                                         self.device)
        self._timer = timer.stop()
        return rows

    def start_exchange(self, payloads: list[torch.Tensor], flag: torch.Tensor | None = None) -> "StartedExchange":
        """The same all_gather, started and not waited for: it runs while the caller computes
        (on CUDA, on NCCL's stream). ``StartedExchange.result()`` waits and returns the bytes."""
        mine, gathered, self.last_traffic, work = self.strategy.start(payloads, self._flag(flag), self.group)
        started = StartedExchange(gathered, work, self.group, self.timeout, sent_row=mine)
        if gathered.is_cuda and work is not None:  # on their way to the host as soon as they land
            started.flags = HostFlags(self.flag_bytes(gathered), work)
        return started

    @property
    def last_exchange_seconds(self) -> float:
        """Wall time of the last exchange (on CUDA: between stream events, read lazily)."""
        return self._timer.seconds() if self._timer is not None else 0.0

    def flag_bytes(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every replica's flag byte, in rank order, on the exchange's device."""
        return self.strategy.flag_bytes(gathered)

    def flags(self, gathered: torch.Tensor) -> list[int]:
        """Every replica's flag byte, in rank order (a host copy)."""
        return self.flag_bytes(gathered).tolist()

    def restore(self, bucket: Bucket, idx: torch.Tensor, vals: torch.Tensor, accs: list[torch.Tensor],
                members: list[int] | None = None) -> None:
        """Give back to the accumulators of ``bucket``'s members (all, or the listed ones) what
        :meth:`select` took out as sent (``idx``/``vals``: the whole bucket's rows, as packed):
        for a payload nobody applied."""
        chosen = [bucket.members[i] for i in members] if members is not None else bucket.members
        for m, acc in zip(chosen, accs):
            rows = slice(m.first_block, m.first_block + m.layout.num_blocks)
            taken = torch.zeros(m.layout.num_blocks, m.layout.block_numel, dtype=acc.dtype, device=acc.device)
            taken.scatter_(1, idx[rows].long(), sent_values(vals[rows].to(acc.dtype), self.encoding))
            acc.add_(blocks_idct(taken, m.layout))

    def dropped(self, bucket: Bucket, decoded_idx: torch.Tensor, idx: torch.Tensor,
                vals: torch.Tensor) -> torch.Tensor | None:
        """The values this replica sent of ``bucket`` (``idx``/``vals``, as selected) that the
        exchange did not apply (``decoded_idx``: :meth:`unpack`'s; the sharded owners' leftovers),
        zero elsewhere, for :meth:`restore`; None where everything sent was applied (all_gather)."""
        return self.strategy.dropped(self._index[id(bucket)], decoded_idx, idx, vals)

    # -- decode -----------------------------------------------------------------------------

    def unpack(self, bucket: Bucket, gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every replica's ``(idx, vals)`` ``[W, B, k]`` of one bucket, from the exchanged bytes (the
        sharded exchange: the owners' means as one voter, ``[1, B, sharded_topk]``)."""
        return self.strategy.unpack(self._index[id(bucket)], gathered)

    def decode_sign_update(self, bucket: Bucket, idx, vals, targets: list[torch.Tensor], lr: float,
                           scale: float = 1.0, keep: torch.Tensor | None = None) -> None:
        """``target = target * scale - lr * sign(IDCT(mean over selecting replicas))`` for every
        member of ``bucket`` (``scale``: a decoupled weight decay, fused into the same pass).
        ``keep``: a 0-dim fp32 0/1 on the device; lr is multiplied by it there (0: only the
        scale applies), so that the caller need not sync the host to decide."""
        if keep is not None:
            lr = (keep.to(torch.float32) * lr).expand(len(bucket.members))  # fp32(lr) or 0, exactly
        bucket.path.decode_sign_update(bucket.members, targets, idx, vals, lr, scale)

    def decode_into(self, bucket: Bucket, idx, vals, member: int, out: torch.Tensor) -> torch.Tensor:
        """``out = IDCT(mean over selecting replicas)`` of one member of ``bucket``."""
        m = bucket.members[member]
        rows = slice(m.first_block, m.first_block + m.layout.num_blocks)
        bucket.path.decode(idx[:, rows], vals[:, rows], m.layout, out)
        return out
