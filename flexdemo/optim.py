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
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from flexdemo.codec import (
    check_encoding,
    clamp_topk,
    mean_of_selected,
    pack_payload,
    payload_nbytes,
    select_topk,
    sent_values,
    unpack_payload,
)
from flexdemo.dct import BlockLayout, block_layout, blocks_dct, blocks_idct


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor (a view sharing storage) of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Slot:
    """One parameter's place in this step's packed exchange."""

    param: torch.Tensor
    lr: float
    layout: BlockLayout
    k: int
    offset: int
    nbytes: int


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
    ):
        _check_hparams(lr, compression_decay, compression_topk, compression_chunk, weight_decay)
        check_encoding(value_encoding)
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
        self.last_step_exchange_seconds = 0.0
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

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        slots, payloads, offset = [], [], 0
        for group in self.param_groups:
            lr, wd, decay = group["lr"], group["weight_decay"], group["compression_decay"]
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                local_p, local_d = _local(p), _local(self._delta(p))
                if wd != 0.0:
                    local_p.mul_(1.0 - lr * wd)
                local_d.mul_(decay)
                # A missing grad counts as zero: every replica must pack the same layout.
                if p.grad is not None:
                    local_d.add_(_local(p.grad), alpha=lr)
                layout = block_layout(local_d.shape, group["compression_chunk"])
                k = clamp_topk(group["compression_topk"], layout.block_numel)
                nbytes = payload_nbytes(layout, k, self.value_encoding)
                slots.append(_Slot(p, lr, layout, k, offset, nbytes))
                offset += nbytes
                if nbytes:
                    payloads.append(compress_momentum(local_d, layout, k, self.value_encoding))

        gathered = self._exchange(payloads, offset, slots)

        for s in slots:
            if s.nbytes == 0:
                continue
            payload = gathered[:, s.offset : s.offset + s.nbytes]
            direction = decode_direction(payload, s.layout, s.k, self.value_encoding, _local(s.param).dtype)
            _local(s.param).add_(direction, alpha=-s.lr)
        return loss

    def _exchange(self, payloads: list[torch.Tensor], total: int, slots: list[_Slot]) -> torch.Tensor:
        """One all_gather of every parameter's payload: returns ``[replicas, total]`` bytes."""
        W = self.replica_world_size
        device = _local(slots[0].param).device if slots else torch.device("cpu")
        mine = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=device)
        start = time.perf_counter()
        if W == 1 or not self._distributed or total == 0:
            gathered = mine.unsqueeze(0)
        else:
            gathered = torch.empty(W * total, dtype=torch.uint8, device=mine.device)
            dist.all_gather_into_tensor(gathered, mine, group=self.replicate_group)
            gathered = gathered.view(W, total)
        self.last_step_exchange_seconds = time.perf_counter() - start
        self.last_step_bytes_sent = total
        self.last_step_bytes_received = (W - 1) * total
        return gathered

    def payload_bytes_per_step(self) -> int:
        """Bytes this rank contributes to each step's exchange (the codec's formula)."""
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    layout = block_layout(_local(p).shape, group["compression_chunk"])
                    total += payload_nbytes(layout, group["compression_topk"], self.value_encoding)
        return total


def compress_momentum(local_d: torch.Tensor, layout: BlockLayout, k: int, encoding: str) -> torch.Tensor:
    """Top-k of delta's DCT as a packed payload; what is sent leaves delta (error feedback)."""
    coeffs = blocks_dct(local_d, layout)
    idx, vals = select_topk(coeffs, k)
    sent = torch.zeros_like(coeffs).scatter_(1, idx, sent_values(vals, encoding))
    local_d.sub_(blocks_idct(sent, layout))
    return pack_payload(idx, vals, layout.block_numel, encoding)


def decode_direction(
    payloads: torch.Tensor, layout: BlockLayout, k: int, encoding: str, dtype: torch.dtype
) -> torch.Tensor:
    """``[replicas, nbytes]`` payloads of one tensor -> ``sign(IDCT(mean over selecting replicas))``."""
    idx, vals = unpack_payload(payloads, layout.num_blocks, k, layout.block_numel, encoding, dtype)
    return blocks_idct(mean_of_selected(idx, vals, layout.block_numel), layout).sign_()


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
