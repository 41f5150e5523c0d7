"""DeMo: decoupled-momentum optimizer whose only cross-replica traffic is a packed,
DCT/top-k compressed momentum (Peng et al. 2024), working on local FSDP2 shards
(FlexDeMo, arXiv 2502.06728).

Per parameter and step, on the local shard:
  1. ``p *= 1 - lr * wd``                    (decoupled weight decay)
  2. ``delta = decay * delta + lr * g``      (momentum with lr folded in)
  3. top-k per chunked-DCT block of delta    (the payload)
  4. ``delta -= IDCT(sent coefficients)``    (error feedback)
then ONE all_gather of every parameter's packed payload over ``replicate_group``, and per
parameter: ``p -= lr * sign(IDCT(mean over selecting replicas))``.

Every replica decodes the same gathered bytes with deterministic ops in the same order,
so replicas that start identical stay bit-identical.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from flexdemo.codec import check_encoding, mean_of_selected, pack_payload, select_topk, sent_values, unpack_payload
from flexdemo.dct import BlockLayout, blocks_dct, blocks_idct
from flexdemo.exchange_plan import Bucket, build_plan
from flexdemo.fused_bucket import fused_decode_bucket, fused_encode_bucket
from flexdemo.fused_codec import fused_pack_payload, fused_supported, fused_unpack_payload
from flexdemo.local import local_tensor as _local


class DeMo(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        *,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        replicate_group: dist.ProcessGroup | None = None,
        value_encoding: str = "sign",
        fused: bool = True,
    ):
        _check_hparams(lr, compression_decay, compression_topk, compression_chunk, weight_decay)
        check_encoding(value_encoding)
        if not isinstance(fused, bool):
            raise ValueError(f"DeMo: fused must be True or False, got {fused!r}")
        # Fused Triton kernels where they apply (CUDA, fp32, >= 2-D, blocks <= 64x64).
        self.fused = fused
        self._cached_plan = None  # add_param_group (called by the base class) resets it
        defaults = dict(
            lr=lr,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_hparams(
                group["lr"], group["compression_decay"], group["compression_topk"],
                group["compression_chunk"], group["weight_decay"],
            )
        self.value_encoding = value_encoding
        self.replicate_group = replicate_group
        self._distributed = dist.is_available() and dist.is_initialized()
        self.replica_world_size = dist.get_world_size(replicate_group) if self._distributed else 1
        self.last_step_bytes_sent = 0
        self.last_step_bytes_received = 0
        self._exchange_timer = None
        _check_meshes(self._trainable(), replicate_group if self._distributed else None)
        if self._distributed:
            self._check_replicas_agree_on_shapes()

    # -- validation ---------------------------------------------------------------------

    def _trainable(self):
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _signature(self) -> str:
        parts = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    parts.append(f"{tuple(_local(p).shape)}:{p.dtype}:{g['compression_topk']}:{g['compression_chunk']}")
        return ";".join(parts) + f"|{self.value_encoding}"

    def _check_replicas_agree_on_shapes(self) -> None:
        """Every replica rank must pack the same layout, or the exchange would be garbage."""
        digest = hashlib.sha256(self._signature().encode()).digest()[:7]
        mine = torch.tensor([len(self._trainable()), int.from_bytes(digest, "little")], dtype=torch.int64)
        mine = mine.to(_collective_device(self._trainable(), self.replicate_group))
        gathered = torch.empty(self.replica_world_size * 2, dtype=torch.int64, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine, group=self.replicate_group)
        rows = gathered.view(-1, 2).tolist()
        ranks = dist.get_process_group_ranks(self.replicate_group or dist.group.WORLD)
        for r, row in enumerate(rows):
            if row != rows[0]:
                raise ValueError(
                    f"DeMo: ranks {ranks[0]} and {ranks[r]} of the replicate group hold different local "
                    f"parameter shapes/dtypes/settings ({rows[0][0]} vs {row[0]} parameters); every replica "
                    "must shard the model identically"
                )

    # -- state ----------------------------------------------------------------------------

    def _delta(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "delta" not in state:
            # Shaped like the parameter (a DTensor if it is one) so DCP can save and reshard it.
            state["delta"] = torch.zeros_like(p)
        return state["delta"]

    # -- step -----------------------------------------------------------------------------

    def _plan(self) -> tuple[list[Bucket], int]:
        """Buckets of this rank's local tensors (shapes never change, so built once)."""
        if self._cached_plan is None:
            entries = [
                [(p, tuple(_local(p).shape), p.dtype) for p in g["params"] if p.requires_grad]
                for g in self.param_groups
            ]
            chunks = [g["compression_chunk"] for g in self.param_groups]
            topks = [g["compression_topk"] for g in self.param_groups]
            self._cached_plan = build_plan(entries, chunks, topks, self.value_encoding)
            # Which path a bucket takes depends only on its tensors' layout, dtype and device.
            for b in self._cached_plan[0]:
                b.fused = self._fused_applies(b)
        return self._cached_plan

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self._cached_plan = None

    def _bucket_is_fused(self, bucket: Bucket) -> bool:
        return bucket.fused

    def _fused_applies(self, bucket: Bucket) -> bool:
        if self.fused is False:
            return False
        return all(
            fused_supported(m.layout, _local(m.param).device, m.param.dtype) and _local(m.param).is_contiguous()
            for m in bucket.members
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        buckets, total = self._plan()
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._delta(p)  # creates the state, also for empty shards
                    if group["weight_decay"] != 0.0:
                        _local(p).mul_(1.0 - group["lr"] * group["weight_decay"])
        # Empty local shards have no payload but their (empty) momentum still exists.

        payloads = [self._encode_bucket(b) for b in buckets]
        gathered = self._exchange(payloads, total, buckets)
        for b in buckets:
            self._decode_bucket(b, gathered[:, b.byte_offset : b.byte_offset + b.nbytes(self.value_encoding)])
        return loss

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        # A missing grad counts as zero: every replica must pack the same layout.
        return None if p.grad is None else _local(p.grad)

    def _encode_bucket(self, b: Bucket) -> torch.Tensor:
        """Momentum update, top-k and error feedback for a bucket's tensors; its packed payload."""
        group = self.param_groups[b.group_index]
        lr, decay, enc = group["lr"], group["compression_decay"], self.value_encoding
        deltas = [_local(self.state[m.param]["delta"]) for m in b.members]
        grads = [self._grad(m.param) for m in b.members]
        if self._bucket_is_fused(b):
            idx, vals = fused_encode_bucket(deltas, grads, lr, decay, [m.layout for m in b.members], b.k, enc)
            return fused_pack_payload(idx, vals, b.block_numel, enc)
        idx_parts, val_parts = [], []
        for m, d, g in zip(b.members, deltas, grads):
            d.mul_(decay)
            if g is not None:
                d.add_(g, alpha=lr)
            idx, vals = compress_momentum(d, m.layout, b.k, enc)
            idx_parts.append(idx)
            val_parts.append(vals)
        return pack_payload(torch.cat(idx_parts), torch.cat(val_parts), b.block_numel, enc)

    def _decode_bucket(self, b: Bucket, payloads: torch.Tensor) -> None:
        """``p -= lr * sign(IDCT(mean over selecting replicas))`` for a bucket's tensors."""
        lr, enc = self.param_groups[b.group_index]["lr"], self.value_encoding
        if self._bucket_is_fused(b):
            idx, vals = fused_unpack_payload(payloads, b.num_blocks, b.k, b.block_numel, enc)
            fused_decode_bucket([_local(m.param) for m in b.members], idx, vals, lr, [m.layout for m in b.members])
            return
        idx, vals = unpack_payload(payloads, b.num_blocks, b.k, b.block_numel, enc, b.dtype)
        for m in b.members:
            rows = slice(m.first_block, m.first_block + m.layout.num_blocks)
            _local(m.param).add_(sign_of_mean(idx[:, rows], vals[:, rows], m.layout), alpha=-lr)

    def _exchange(self, payloads: list[torch.Tensor], total: int, buckets: list[Bucket]) -> torch.Tensor:
        """One all_gather of every bucket's payload: returns ``[replicas, total]`` bytes."""
        W = self.replica_world_size
        device = _local(buckets[0].members[0].param).device if buckets else self._device()
        mine = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=device)
        assert mine.numel() == total, (mine.numel(), total)
        timer = _ExchangeTimer(mine.device)
        if W == 1 or not self._distributed or total == 0:
            gathered = mine.unsqueeze(0)
        else:
            gathered = torch.empty(W * total, dtype=torch.uint8, device=mine.device)
            dist.all_gather_into_tensor(gathered, mine, group=self.replicate_group)
            gathered = gathered.view(W, total)
        self._exchange_timer = timer.stop()
        self.last_step_bytes_sent = total
        self.last_step_bytes_received = (W - 1) * total
        return gathered

    @property
    def last_step_exchange_seconds(self) -> float:
        """Wall time of the last step's all_gather (on CUDA: between stream events, read lazily)."""
        return self._exchange_timer.seconds() if self._exchange_timer is not None else 0.0

    def _device(self) -> torch.device:
        return _collective_device(self._trainable(), self.replicate_group)

    def payload_bytes_per_step(self) -> int:
        """Bytes this rank contributes to each step's exchange (the codec's formula)."""
        return self._plan()[1]


def compress_momentum(
    local_d: torch.Tensor, layout: BlockLayout, k: int, encoding: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of delta's DCT per block as ``(indices, values)``; what is sent leaves delta
    (error feedback)."""
    coeffs = blocks_dct(local_d, layout)
    idx, vals = select_topk(coeffs, k)
    sent = torch.zeros_like(coeffs).scatter_(1, idx, sent_values(vals, encoding))
    local_d.sub_(blocks_idct(sent, layout))
    return idx, vals


def sign_of_mean(idx: torch.Tensor, vals: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """Replicas' ``[W, B, k]`` coefficients of one tensor -> ``sign(IDCT(mean over selecting replicas))``."""
    return blocks_idct(mean_of_selected(idx, vals, layout.block_numel), layout).sign_()


def decode_direction(
    payloads: torch.Tensor, layout: BlockLayout, k: int, encoding: str, dtype: torch.dtype
) -> torch.Tensor:
    """``[replicas, nbytes]`` payloads of one tensor -> ``sign(IDCT(mean over selecting replicas))``."""
    idx, vals = unpack_payload(payloads, layout.num_blocks, k, layout.block_numel, encoding, dtype)
    return sign_of_mean(idx, vals, layout)


class _ExchangeTimer:
    """Times the exchange without a host sync: CUDA collectives are asynchronous, so on CUDA
    two stream events bracket it and the elapsed time is read only when asked for."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.start = time.perf_counter()

    def stop(self) -> "_ExchangeTimer":
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


def _check_hparams(lr, decay, topk, chunk, weight_decay) -> None:
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"DeMo: lr must be a positive number, got {lr!r}")
    if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
        raise ValueError(f"DeMo: compression_decay must be in [0, 1), got {decay!r}")
    if not (isinstance(topk, int) and not isinstance(topk, bool) and topk > 0):
        raise ValueError(f"DeMo: compression_topk must be a positive int, got {topk!r}")
    if not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0):
        raise ValueError(f"DeMo: compression_chunk must be a positive int, got {chunk!r}")
    if not (isinstance(weight_decay, (int, float)) and weight_decay >= 0):
        raise ValueError(f"DeMo: weight_decay must be >= 0, got {weight_decay!r}")


def _check_meshes(params, replicate_group) -> None:
    """All DTensor params must live on one mesh, orthogonal to the replicate group."""
    mesh = None
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if any(isinstance(pl, Partial) for pl in p.placements):
            raise ValueError("DeMo: parameters with Partial placements are not supported")
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError(
                f"DeMo: parameters live on different device meshes ({mesh} and {p.device_mesh}); "
                "DeMo compresses local shards of one mesh and exchanges them over one replicate group"
            )
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return
    replica_ranks = set(dist.get_process_group_ranks(replicate_group or dist.group.WORLD))
    overlap = replica_ranks & set(mesh.mesh.flatten().tolist())
    if overlap != {dist.get_rank()}:
        raise ValueError(
            f"DeMo: the replicate group {sorted(replica_ranks)} overlaps the parameters' mesh "
            f"{mesh.mesh.tolist()} in ranks {sorted(overlap)}; the replicate group must contain exactly "
            "one rank of each shard group (pass the dp_replicate group, not the world)"
        )


def _collective_device(params, group) -> torch.device:
    # Collectives run where the parameters live (NCCL needs CUDA tensors, gloo CPU ones).
    return _local(params[0]).device if params else torch.device("cpu")
