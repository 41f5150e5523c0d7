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

With ``overlap=True`` the all_gather of step t is started and not waited for; its update is
applied at the start of step t+1 (before that step's weight decay), so the exchange runs while
the next forward/backward computes: the gradient of step t+1 does not yet see update t (one
step of delay, as production ports of DeMo do). ``lookahead=True`` meanwhile trains on this
replica's own share of update t (:mod:`flexdemo.optim.lookahead`).

A non-finite gradient on any shard of a replica is found before anything is sent (agreed over
the replica's shards, on the fast link) and counts as zero there; the replica says so in its
payload's flag byte, so every replica learns it from the exchange itself. Then, by
``nonfinite``: "skip": no replica applies the step's update and each puts what it sent back
into its momentum (weight decay still applies, alike on every replica); "stop": every replica
raises :class:`NonFiniteGradientError`, the replica that saw it naming the parameter.

A step does not wait on the host: the non-finite flag is read by the encode on the GPU, "skip"
gates the update there, and the flag bytes reach the host in the background (with overlap, on a
side stream as soon as the exchange lands), read before the momentum is next used (the next
step, ``state_dict``). A CPU that waits for the GPU mid-step leaves the GPU idle while it
launches the next step's kernels (on NVLink that cost FlexDeMo 10% of its tokens/s).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flexdemo.compression.compressor import HostFlags, StartedExchange, TopkCompressor
from flexdemo.compression.mesh_layout import TPReplicated, check_replicate_group, shard_groups_of
from flexdemo.compression.exchange import NonFiniteError, nonfinite_flags
from flexdemo.local import local_grad
from flexdemo.local import local_tensor as _local
from flexdemo.replica_group import ReplicaGroup, replica_group
from flexdemo.optim.demo_args import check_args, check_hparams
from flexdemo.optim.lookahead import BASE_KEY, LookaheadMixin
from flexdemo.optim.momentum_storage import MomentumStorage
from flexdemo.optim.overlap import OverlapMixin


class NonFiniteGradientError(NonFiniteError):
    """A replica saw a non-finite gradient and ``nonfinite="stop"``: raised on every replica."""


class DeMo(OverlapMixin, LookaheadMixin, torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        *,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
        replicate_group: dist.ProcessGroup | ReplicaGroup | None = None,
        value_encoding: str = "sign",
        fused: bool = True,
        overlap: bool = False,
        kernel_precision: str = "tf32x3",
        exchange_timeout: float | None = None,
        nonfinite: str = "skip",
        exchange: str = "allgather",
        sharded_topk: int = 0,
        lookahead: bool = False,
        index_coding: str = "fixed",
        momentum_dtype: str = "float32",
        momentum_device: str = "device",
    ):
        check_hparams(lr, compression_decay, compression_topk, compression_chunk, weight_decay)
        check_args(lookahead, overlap, value_encoding, exchange, fused, nonfinite)
        self.nonfinite = nonfinite
        # bf16: 2 bytes per parameter, widened to fp32 for each step's arithmetic and stochastically
        # rounded back; "cpu": in pinned host memory, streamed through the GPU each step
        # (flexdemo.optim.momentum_storage).
        self.momentum = MomentumStorage(momentum_dtype, fused, momentum_device)
        self.param_names: dict[int, str] = {}  # id(param) -> name, for messages (set by the caller)
        # nonfinite="skip": the last exchange's flags on their way to the host and what this
        # replica sent then (put back if a replica flagged a non-finite gradient), read before
        # the momentum is next used (_settle): no host sync in the step itself.
        self._unsettled: tuple[HostFlags, list | None] | None = None
        self._last_skipped: list[int] = []
        self._skip_reports: list[tuple[int, list[int]]] = []  # (step, replicas) of skipped steps
        self._steps_done = 0
        # The last step's non-finite flag per local gradient (device) and (index, param) of each.
        self._bad_here: tuple[torch.Tensor, list] = (torch.zeros(0, dtype=torch.bool), [])
        self.overlap, self.lookahead = overlap, lookahead
        self.kernel_precision = kernel_precision
        self.exchange_timeout = exchange_timeout
        self.exchange, self.sharded_topk = exchange, sharded_topk
        self.index_coding = index_coding  # "fixed" or "elias_fano" (flexdemo.wire.format)
        self._pending: StartedExchange | None = None  # overlap: the last step's exchange
        self._pending_lrs: list[float] = []
        self._waited_seconds = 0.0
        # Fused Triton kernels where they apply (CUDA, fp32, >= 2-D, blocks <= 64x64).
        self.fused = fused
        defaults = dict(
            lr=lr,
            compression_decay=compression_decay,
            compression_topk=compression_topk,
            compression_chunk=compression_chunk,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            check_hparams(
                group["lr"], group["compression_decay"], group["compression_topk"],
                group["compression_chunk"], group["weight_decay"],
            )
        self.value_encoding = value_encoding
        self.replicate_group = replica_group(replicate_group)
        check_replicate_group(self._trainable(), self.replicate_group, who="DeMo")
        if overlap and not self.replicate_group.membership_fixed:
            raise ValueError("DeMo: overlap leaves an exchange in flight across steps, and an elastic replica "
                             "group may change between them; turn overlap off with fault tolerance")
        self._shard_groups = shard_groups_of(self._trainable())
        self.compressor = self._build_compressor()

    def _trainable(self):
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _exchanged(self):
        """The trainable parameters this rank compresses and keeps momentum for: all but those TP
        replicates and another TP rank owns (:mod:`flexdemo.compression.mesh_layout`)."""
        return [p for p in self._trainable() if self._tp.exchanged(p)]

    def _build_compressor(self) -> TopkCompressor:
        # Local shapes never change, so the plan is built once (and again if groups are added).
        self._tp = TPReplicated(self._trainable())
        self.momentum.bind(self._trainable())  # places among all of them: the rounding seeds
        return TopkCompressor(
            [[p for p in g["params"] if p.requires_grad and self._tp.exchanged(p)] for g in self.param_groups],
            [g["compression_chunk"] for g in self.param_groups],
            [g["compression_topk"] for g in self.param_groups],
            self.value_encoding,
            self.replicate_group,
            fused=self.fused,
            kernel_precision=self.kernel_precision,
            timeout=self.exchange_timeout,
            who="DeMo",
            agree=self._settings(),
            exchange=self.exchange,
            sharded_topk=self.sharded_topk,
            index_coding=self.index_coding,
        )

    def _settings(self) -> dict[str, str]:
        """DeMo's own settings that replicas must share: another initial lr, decay or weight
        decay moves the replicas apart from the first step; another overlap or non-finite
        action pairs different collectives or skips on one replica only."""
        out = {"overlap": str(self.overlap), "lookahead": str(self.lookahead), "nonfinite": self.nonfinite}
        for i, g in enumerate(self.param_groups):
            out[f"param group {i}"] = (f"lr {g['lr']!r}, decay {g['compression_decay']!r}, "
                                       f"weight decay {g['weight_decay']!r}")
        return out

    # -- state ----------------------------------------------------------------------------

    def _delta(self, p: torch.Tensor) -> torch.Tensor:
        return self.momentum.create(p, self.state[p])

    # -- step -----------------------------------------------------------------------------

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        if getattr(self, "compressor", None) is not None:  # the base class adds the first groups
            self.compressor = self._build_compressor()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        comp = self.compressor
        # overlap: the update exchanged last step comes first, before this step's weight decay.
        # Otherwise the weight decay rides along with this step's update (decode_sign_update's
        # scale: one pass over the parameters, not two); nothing reads them in between.
        self._waited_seconds = 0.0
        self._settle()  # the last step's flags, copied to the host long ago: no wait
        self._last_skipped = []
        if self._pending is not None:
            self.finish_pending()
        self._create_state()
        scales = self._weight_decay_scales()
        if self.overlap:
            self._decay_weights(scales)
        # Every local gradient once, in one order on every rank: laying one out like its parameter
        # may be a collective over the replica's shards (a TP-Partial gradient).
        local_grads = {id(p): local_grad(p) for p in self._trainable()}
        bad = self._nonfinite_here(local_grads)

        payloads, sent = [], []
        for b in comp.buckets:
            # A missing grad counts as zero (every replica must pack the same layout), and so
            # does every grad of a replica that saw a non-finite one (bad, read on the device).
            grads = [local_grads[id(m.param)] for m in b.members]
            group = self.param_groups[b.group_index]
            idx, vals = self.momentum.select(comp, b, self.state, grads, scale=group["lr"],
                                             decay=group["compression_decay"], skip_incs=bad)
            sent.append((idx, vals))
            payloads.append(comp.pack(b, idx, vals))
        self.momentum.count_step(self.state, self._exchanged())
        lrs = [g["lr"] for g in self.param_groups]
        flag = bad.to(torch.uint8)
        if self.overlap:
            self._pending, self._pending_lrs = comp.start_exchange(payloads, flag), lrs
            self._pending_sent = sent
            if self.lookahead:
                self._apply_lookahead()
        else:
            gathered = comp.exchange(payloads, flag)
            if comp.commit():
                self._finish(gathered, lrs, sent, scales)
            else:  # elastic: this exchange failed here (a replica was lost mid-way); not applied
                self._give_back(sent)
        self._mirror_replicated()
        self._steps_done += 1
        return loss

    def _mirror_replicated(self) -> None:
        """TP ranks that do not own a replicated parameter take its owner's values (and, with the
        look-ahead, its base), once everything this step applies to them is applied."""
        if not self._tp.params:
            return
        if self.lookahead:
            self._lookahead_bases()  # made alike on every TP rank, so the broadcasts match
        self._tp.mirror([self.state[p][BASE_KEY] for p in self._tp.params] if self.lookahead else [])

    def _give_back(self, sent) -> None:
        """A step nobody applied: what this replica sent goes back into its momentum."""
        for b, (idx, vals) in zip(self.compressor.buckets, sent):
            self.momentum.restore(self.compressor, b, self.state, idx, vals)

    def _nonfinite_here(self, local_grads: dict[int, torch.Tensor | None]) -> torch.Tensor:
        """Whether any local gradient of this replica is non-finite (agreed over its shards), as a
        one-element fp32 tensor on the device: no host sync before the encode, whose kernels read
        it. Which local gradients were non-finite is kept on the device too, for the message of
        ``nonfinite="stop"`` (:meth:`_finish`)."""
        with_grad = [(i, p) for i, p in enumerate(self._trainable()) if p.grad is not None]
        each, bad = nonfinite_flags([local_grads[id(p)] for _, p in with_grad], self._shard_groups,
                                    self.compressor.device)
        self._bad_here = (each, with_grad)
        return bad.reshape(1)

    def _finish(self, gathered: torch.Tensor, lrs: list[float], sent, scales: list[float] | None = None,
                flags: HostFlags | None = None) -> None:
        """Apply an exchange's update, unless a replica flagged a non-finite gradient; ``scales``:
        this step's weight decay (one factor per group), when it was left to the update.

        "skip" decides on the device: the update's lr is multiplied by (no replica flagged), the
        weight decay applies either way, and the flags go to the host in the background; if one
        was set, :meth:`_settle` puts what this replica sent back into its momentum before
        anything reads the momentum again. "stop" reads the flags at once, to raise before any
        update."""
        comp = self.compressor
        if self.nonfinite == "skip":
            self._settle()
            keep = (comp.flag_bytes(gathered) == 0).all().to(torch.float32)
            self._apply(gathered, lrs, scales, keep, sent)
            self._unsettled = (flags if flags is not None else HostFlags(comp.flag_bytes(gathered)), sent)
            return
        bad = [r for r, flag in enumerate(comp.flags(gathered)) if flag]  # "stop"
        if not bad:
            self._apply(gathered, lrs, scales, sent=sent)
            return
        each, with_grad = self._bad_here
        bad_here = [self.param_names.get(id(p), f"parameter {i}")  # a host copy, on this path only
                    for (i, p), b in zip(with_grad, each.tolist()) if b]
        here = f"; here in {', '.join(bad_here)}" if bad_here else ""
        raise NonFiniteGradientError(
            f"DeMo: a non-finite gradient on replica(s) {bad}{here}; stopping before it reaches a parameter "
            "([flexdemo] nonfinite = \"skip\" skips such steps instead)"
        )

    def _settle(self, wait: bool = True) -> None:
        """nonfinite="skip": read the last exchange's flags (``wait=False``: only if already on
        the host) and, if a replica flagged a non-finite gradient, put what this replica sent
        back into its momentum (nobody applied it) and record the skipped step."""
        if self._unsettled is None or not (wait or self._unsettled[0].ready()):
            return
        (flags, sent), self._unsettled = self._unsettled, None
        bad = [r for r, flag in enumerate(flags.values()) if flag]
        self._last_skipped = bad
        if not bad:
            return
        self._skip_reports.append((self._steps_done, bad))
        if sent is None:  # pending_state resolves a skipped exchange before checkpointing it
            raise RuntimeError("DeMo: a skipped exchange carried over a checkpoint has no momentum to restore")
        self._give_back(sent)

    @property
    def last_step_skipped_by(self) -> list[int]:
        """Replicas whose non-finite gradient skipped the last step's update (reading it waits
        for that step's exchange; :meth:`pop_skipped_steps` does not)."""
        self._settle()
        return list(self._last_skipped)

    def pop_skipped_steps(self, wait: bool = False) -> list[tuple[int, list[int]]]:
        """(steps ago: 0 for the last step, replicas) of every step whose update was skipped,
        since the last call, as far as known without waiting (``wait``: up to the last step)."""
        self._settle(wait)
        out = [(self._steps_done - step, bad) for step, bad in self._skip_reports]
        self._skip_reports = []
        return out

    def state_dict(self):
        self._settle()  # the momentum as it is once a skipped step's payload is put back
        self.momentum.settled(self._trainable())  # a host momentum: its last copies landed
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self._settle()
        # The momentum in its own dtype and place, not cast to the parameter's by torch.
        state_dict, momenta = self.momentum.split_off(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        self.momentum.adopt(self.state, momenta)
        self._restore_lookahead()
        self._mirror_replicated()

    def _apply(self, gathered: torch.Tensor, lrs: list[float], scales: list[float] | None,
               keep: torch.Tensor | None = None, sent=None) -> None:
        """``p = p * scale - keep * lr * sign(IDCT(mean over selecting replicas))`` from every
        replica's bytes (``scales`` None: 1; ``keep`` None: 1). The sharded exchange: what this
        replica ``sent`` that the owners dropped goes back into its momentum (times ``keep``: a
        skipped step gets all of it back from :meth:`_settle` instead)."""
        comp = self.compressor
        feedback = not comp.strategy.applies_all_sent  # the sharded owners drop some of what was sent
        if feedback and sent is None:
            raise RuntimeError("DeMo: the sharded exchange's update needs what this replica sent")
        for i, b in enumerate(comp.buckets):
            idx, vals = comp.unpack(b, gathered)
            scale = scales[b.group_index] if scales is not None else 1.0
            comp.decode_sign_update(b, idx, vals, [_local(m.param) for m in b.members], lrs[b.group_index], scale,
                                    keep)
            if feedback:
                dropped = comp.dropped(b, idx, *sent[i])
                self.momentum.restore(comp, b, self.state, sent[i][0], dropped if keep is None else dropped * keep)

    def _create_state(self) -> None:
        for p in self._exchanged():
            self._delta(p)  # also for empty shards (no payload)
        if self.lookahead:
            self._lookahead_bases()

    def _weight_decay_scales(self) -> list[float]:
        return [1.0 - g["lr"] * g["weight_decay"] for g in self.param_groups]

    def _decay_weights(self, scales: list[float]) -> None:
        for group, scale in zip(self.param_groups, scales):
            params = [_local(p) for p in group["params"] if p.requires_grad]
            if scale != 1.0 and params:
                # One multi-tensor launch per group (the same bits as a mul_ per tensor).
                torch._foreach_mul_(params, scale)

    @property
    def last_step_bytes_sent(self) -> int:
        """This rank's payload bytes in the last step."""
        return self.compressor.last_traffic.sent

    @property
    def last_step_bytes_received(self) -> int:
        """Other replicas' payload bytes this rank received in the last step (``(replicas - 1) x``)."""
        return self.compressor.last_traffic.received

    @property
    def last_step_exchange_seconds(self) -> float:
        """Wall time of the last step's all_gather (on CUDA: between stream events, read lazily);
        with overlap, how long the step waited for the exchange started the step before."""
        if self.overlap:
            return self._waited_seconds
        return self.compressor.last_exchange_seconds

    def payload_bytes_per_step(self) -> int:
        """Bytes this rank contributes to each step's exchange (the codec's formula)."""
        return self.compressor.nbytes

