"""DiLoCo's outer step on local shards, every ``sync_interval`` inner steps (Douillard et al.,
arXiv 2311.08105), optionally with the outer exchange compressed by DeMo's chunked DCT + top-k
+ error feedback (Nedelkoski et al., arXiv 2510.03371).

Between syncs each replica trains alone (the inner optimizer; nothing crosses the replica
group). At a sync, per parameter and on this rank's local shard:

1. pseudo-gradient ``pg = global - local`` (``global``: the parameters of the last sync);
2. outer gradient, identical on every replica:
   - ``"dense"`` (DiLoCo): ``mean over replicas of pg`` with fp32 or bf16 on the wire;
   - ``"topk"`` (DeMo-DiLoCo): ``e = decay * e + pg``; top-k per DCT block of ``e``;
     ``e -= IDCT(sent)``; one packed all_gather; ``IDCT(mean over the replicas that selected
     each coefficient)``. Unlike the paper's code, the worker's own uncompressed ``pg`` is
     never added back, so the update depends only on bytes every replica received
     (``transform="none"``, SparseLoCo's rule: top-k of ``e``'s raw blocks, no DCT);
3. the caller's outer optimizer, given at construction as torchft's ``DiLoCo`` takes it
   (``outer_optimizer=torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)``;
   ``outer_sgd(...)`` builds it from the TOML keys): the parameters := ``global``, the outer
   gradient into their ``.grad``, its ``step()``, ``global :=`` the result (diloco_outer.py,
   :class:`OuterStep`). SGD with dampening 0: ``m = mu * m + g``, the step ``g + mu * m``
   (Nesterov) or ``m``, ``global -= lr * step``; its lr is read at every outer step (an lr
   scheduler on it works), its momentum and Nesterov at construction (the replicas agree on
   them), and its momentum buffers are the checkpointed ``momentum`` tensors. Only SGD is taken
   (DiLoCo's checkpoint and heal carry SGD's state only); with ``state_device="cpu"`` its
   param group drives torch's functional ``sgd`` on each streamed tensor instead of ``step()``;
4. ``local := global`` (the parameters hold it after step 3).

Every replica computes the same bits in steps 2-4, so replicas are bit-identical after every
sync. A replica whose cycle produced non-finite parameters (found before anything is sent,
agreed over its shards) sends zeros and says so in the exchange (the payload's flag byte, or
one extra element of the dense mean); then, by ``nonfinite``, every replica skips the outer
step alike (global copy and momentum unchanged, error feedback given back what it sent, local
:= global: the cycle is discarded) or raises :class:`NonFiniteError`. Either way every rank
learns which replicas and parameters were non-finite (two small object all_gathers, on such a
cycle only).

A discarded cycle also **resets** the inner optimizers' state on every replica (given as
``inner_optimizers=``, as flexdemo's torchtitan container passes them, or by
:meth:`set_inner_optimizers` where they are built after the DiLoCo): every state tensor is zeroed in place, for Adam/AdamW
exactly a fresh state (step 0, zero moments), so the next cycle starts from finite moments
(keeping them left the replica that blew up NaN forever: every later cycle was discarded too).
Reset, not restore: restoring the cycle's starting moments needs a snapshot of them at every
outer step, 8 more bytes per parameter for AdamW and a copy per outer step, on the healthy path,
to save a few dozen steps of moment re-estimation after a rare fault; a reset costs nothing
until it is needed, and Adam's bias correction makes a fresh state well defined (its first
steps move each weight by about the current lr, as at a run's start). Every replica resets, not
only the one that blew up, so that after a discarded cycle all replicas are in the same
condition (the global copy, a fresh inner state) whichever one failed. The LR schedule goes on.

Over an elastic replica group (torchft; flexdemo.elastic) the replicas of an outer step are
those of the quorum formed at its cycle's start, and the mean is over them. After the exchange
torchft says whether the step may be applied (:meth:`ElasticGroup.commit`); one that may not
(a replica was lost during the exchange) is not applied anywhere it failed: the error feedback
gets back what it sent, the global copy and momentum stay, and the local parameters keep their
progress, so the next outer step's pseudo-gradient covers both cycles (nothing is discarded).

``max_consecutive_skips`` (0: never) discarded cycles in a row raise :class:`RepeatedSkipsError`
on every rank, naming the replicas and parameters: a fault that repeats every cycle (bad data,
an inner lr that diverges) stops the run instead of letting it go on without learning.

State (``global``, outer momentum, error feedback: 12 bytes per parameter) lives on the
parameters' device, or with ``state_device="cpu"`` in pinned host memory, streamed one tensor at a time.

The inner optimizers are required (else their NaN moments would discard every later cycle): the
first step refuses with a ValueError naming the call when none were given (``()``: no state).
"""

from __future__ import annotations

from typing import Iterable

import torch

from flexdemo.compression.agreement import check_settings_agree, dense_settings, diloco_settings
from flexdemo.compression.compressor import TopkCompressor
from flexdemo.compression.mesh_layout import TPReplicated, check_replicate_group, shard_groups_of
from flexdemo.compression.exchange import (
    ExchangeTimer,
    NonFiniteError,
    Traffic,
    distributed,
    nonfinite_flags,
)
from flexdemo.local import local_tensor
from flexdemo.replica_group import replica_group
from flexdemo.optim.diloco_args import WIRE_DTYPES, Compression, StateDevice, check_args
from flexdemo.optim.diloco_dense import dense_outer_exchange
from flexdemo.optim.diloco_outer import (
    Entry,
    OuterStep,
    entries_state_dict,
    entry_keys,
    load_entries,
    load_shared_copies,
    new_entry,
    outer_param_group,
    outer_sgd,  # noqa: F401  (the outer optimizer the TOML keys describe, for callers)
    shared_copies,
)
from flexdemo.optim.diloco_topk import topk_outer_exchange
from flexdemo.optim.nonfinite import (
    RepeatedSkipsError,
    SkipStreak,
    describe_nonfinite,
    replicas_that_saw_it,
    reset_optimizer_state,
)
from flexdemo.wire.format import check_index_coding


class DiLoCo:
    """The outer loop around an inner optimizer: call :meth:`before_inner_step` and
    :meth:`after_inner_step` around every inner ``optimizer.step()``."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        *,
        outer_optimizer: torch.optim.Optimizer,
        sync_interval: int,
        compression: Compression = "dense",
        value_encoding: str = "fp32",
        topk: int = 32,
        chunk: int = 64,
        decay: float = 0.9,
        replicate_group=None,
        state_device: StateDevice = "device",
        fused: bool = True,
        kernel_precision: str = "tf32x3",
        exchange_timeout: float | None = None,
        nonfinite: str = "skip",
        max_consecutive_skips: int = 10,
        exchange: str = "allgather",
        sharded_topk: int = 0,
        index_coding: str = "fixed",
        transform: str = "dct",
        inner_optimizers: Iterable[torch.optim.Optimizer] | None = None,
    ):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        group = outer_param_group(outer_optimizer, [p for _, p in named], [n for n, _ in named])
        # the replicas agree on these (read at construction; the lr is read again at every step)
        outer_lr, outer_momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
        check_args(sync_interval, outer_lr, outer_momentum, nesterov, compression, value_encoding,
                   topk, chunk, decay, state_device, max_consecutive_skips, nonfinite, transform)
        check_index_coding(index_coding)
        self.sync_interval = sync_interval
        self.outer_optimizer = outer_optimizer
        self.compression, self.value_encoding, self.decay = compression, value_encoding, float(decay)
        self.replicate_group = replica_group(replicate_group)
        self.offload = state_device == "cpu"
        self.exchange_timeout = exchange_timeout
        self.nonfinite = nonfinite
        self.last_sync_skipped = False
        self.last_sync_committed = True  # False: an elastic exchange failed; the cycle goes on
        self.failed_syncs = 0  # such outer steps since this object was built
        self.skips = SkipStreak(max_consecutive_skips)  # discarded cycles: in all, and in a row
        self.last_skipped_by: dict[int, list[str]] = {}  # of the last discarded cycle: replica -> names
        self.inner_optimizers: list[torch.optim.Optimizer] | None = None
        if inner_optimizers is not None:
            self.set_inner_optimizers(inner_optimizers)
        self._shard_groups = shard_groups_of([p for _, p in named])
        check_replicate_group([p for _, p in named], self.replicate_group, who="DiLoCo")
        # a parameter TP replicates is synced by its owner TP rank; the others mirror it
        self._tp = TPReplicated([p for _, p in named])

        self.entries = [new_entry(n, p, self.offload, outer_momentum > 0, compression == "topk")
                        for n, p in named if self._tp.exchanged(p)]
        self._outer = OuterStep(outer_optimizer, group, self.entries, self.offload)
        self.inner_steps = 0  # inner steps since the last sync (the position in the H-step cycle)
        self.outer_steps = 0
        self.has_global = False  # set at the first cycle's start, or by loading a checkpoint
        self.last_traffic = Traffic()  # of the last inner step: zero unless it ended with a sync
        self._timers: list[ExchangeTimer] = []
        self._sync_timer: ExchangeTimer | None = None  # the whole last outer step

        params = [e.param for e in self.entries]
        agree = diloco_settings(compression, value_encoding, sync_interval, outer_lr, outer_momentum, nesterov)
        # a replica that stops where the others skip would leave them waiting in the next exchange
        agree.update(nonfinite=nonfinite, max_consecutive_skips=str(max_consecutive_skips))
        if compression == "topk":
            self.compressor = TopkCompressor([params], [chunk], [topk], value_encoding, self.replicate_group,
                                             fused=fused, kernel_precision=kernel_precision,
                                             timeout=exchange_timeout, who="DiLoCo", agree=agree,
                                             exchange=exchange, sharded_topk=sharded_topk,
                                             index_coding=index_coding, transform=transform)
            self._member_entry = {id(e.param): e for e in self.entries}
        else:
            self.compressor = None
        # What replicas must share to decode alike: compared now, and by a joining elastic replica.
        self.settings = self.compressor.settings if self.compressor is not None else {**agree, **dense_settings(params)}
        if self.compressor is None and distributed():
            check_settings_agree("DiLoCo", self.settings, self.replicate_group, _device_of(params))

    # -- state ------------------------------------------------------------------------------

    @torch.no_grad()
    def before_inner_step(self) -> None:
        """At the first cycle's start (no checkpoint loaded): global := the parameters. Refuses
        (ValueError) without the inner optimizers."""
        if self.inner_optimizers is None:
            raise ValueError(
                "DiLoCo: no inner optimizers: pass DiLoCo(..., inner_optimizers=[inner]) or call "
                "set_inner_optimizers([inner]) before the first step; a discarded (non-finite) cycle "
                "resets their state, without which their NaN moments would discard every later cycle "
                "(inner_optimizers=() if the inner steps keep no state)")
        if not self.has_global:
            for e in self.entries:
                e.global_copy.copy_(local_tensor(e.param))
            self.has_global = True

    def after_inner_step(self) -> bool:
        """Count one inner step; run the outer step when the cycle is complete. True if it ran."""
        self.inner_steps += 1
        if self.inner_steps < self.sync_interval:
            self.last_traffic, self._timers = Traffic(), []
            return False
        self.sync()
        return True

    def set_inner_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The optimizers of the inner steps, whose state a discarded cycle resets: for a caller
        that builds them after the DiLoCo; otherwise pass ``inner_optimizers=`` (flexdemo's
        torchtitan container does: it builds the DiLoCo around the inner optimizers it made)."""
        optimizers = list(optimizers)
        wrong = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
        if wrong:
            raise TypeError(f"DiLoCo: inner_optimizers must be torch.optim.Optimizer instances, got {wrong}")
        self.inner_optimizers = optimizers

    def state_bytes_per_param(self) -> int:
        return 4 * (1 + (self._outer.fixed["momentum"] > 0) + (self.compression == "topk"))

    # -- the outer step ---------------------------------------------------------------------

    @torch.no_grad()
    def sync(self) -> None:
        self.before_inner_step()
        self._timers = []
        locals_ = [local_tensor(e.param) for e in self.entries]
        device = locals_[0].device if locals_ else torch.device("cpu")
        timer = ExchangeTimer(device)
        each, bad = nonfinite_flags(locals_, self._shard_groups, device)
        bad = bool(bad.item())
        if self.compression == "topk":
            self.last_traffic, skip = self._sync_topk(bad)
        else:
            self.last_traffic, skip = self._sync_dense(bad)
        self.last_sync_skipped = bool(skip)
        if skip is None:  # elastic, not committed: nothing applied, the local progress kept
            self.failed_syncs += 1
        elif skip:
            self._discard_cycle(bad, each)
        else:
            self.last_skipped_by = {}
            self.skips.applied()
        self._tp.mirror()
        self.last_sync_committed = skip is not None
        if self.offload and self.entries and local_tensor(self.entries[0].param).is_cuda:
            torch.cuda.current_stream().synchronize()  # host copies complete before anyone reads them
        self.inner_steps = 0
        self.outer_steps += skip is not None
        self._sync_timer = timer.stop()
        if skip:
            self._stop_if_repeated()

    def _discard_cycle(self, bad: bool, each: torch.Tensor) -> None:
        """Every replica alike (the skip is agreed): back to the global copy with a fresh inner
        optimizer state, or (``nonfinite="stop"``) raise."""
        self.last_skipped_by = replicas_that_saw_it([e.name for e in self.entries], each, bad, self._shard_groups,
                                                    self.replicate_group)
        if self.nonfinite == "stop":
            raise NonFiniteError(
                f"DiLoCo: non-finite parameters after the inner steps on {describe_nonfinite(self.last_skipped_by)}; "
                "stopping before the outer step ([flexdemo] nonfinite = \"skip\" discards such a cycle instead)"
            )
        for e in self.entries:
            local_tensor(e.param).copy_(self._on_device(e.global_copy, local_tensor(e.param)))
        reset_optimizer_state(self.inner_optimizers)
        self.skips.skipped(self.outer_steps, self.last_skipped_by)

    def _stop_if_repeated(self) -> None:
        if self.skips.over_limit:
            raise RepeatedSkipsError(
                f"DiLoCo: {len(self.skips.in_a_row)} outer steps in a row skipped "
                f"(max_consecutive_skips = {self.skips.limit}), "
                f"the last for non-finite parameters on {describe_nonfinite(self.last_skipped_by)}: the fault "
                "repeats every cycle (bad data? an inner lr that diverges?); stopping"
            )

    def _sync_dense(self, bad: bool) -> tuple[Traffic, bool | None]:
        traffic, skip, self._timers = dense_outer_exchange(
            self.entries, bad, self._on_device, self._apply_mean, self.replicate_group,
            WIRE_DTYPES[self.value_encoding], self.exchange_timeout)
        return traffic, skip

    def _apply_mean(self, bucket: list[Entry], mean: torch.Tensor) -> None:
        pairs, offset = [], 0
        for e in bucket:
            local = local_tensor(e.param)
            pairs.append((e, mean[offset : offset + local.numel()].view(local.shape)))
            offset += local.numel()
        self._outer.step(pairs)

    def _sync_topk(self, bad: bool) -> tuple[Traffic, bool | None]:
        traffic, skip, timer = topk_outer_exchange(self.compressor, self._member_entry, bad, self.decay,
                                                   self._on_device, self._to_state, self._outer.step)
        self._timers.append(timer)
        return traffic, skip

    def _on_device(self, state: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return state.to(like.device, non_blocking=True) if self.offload else state

    def _to_state(self, state: torch.Tensor, value: torch.Tensor) -> None:
        if self.offload:
            state.copy_(value, non_blocking=True)

    # -- metrics ----------------------------------------------------------------------------

    @property
    def last_exchange_seconds(self) -> float:
        """Wall time of the last sync's collectives (CUDA: between stream events, read lazily)."""
        return sum(t.seconds() for t in self._timers)

    @property
    def last_sync_seconds(self) -> float | None:
        """Device time of the whole last outer step (codec, collectives, outer update; CUDA:
        between stream events, so what the GPU spent, not the host's launch time); None before
        the first."""
        return None if self._sync_timer is None else self._sync_timer.seconds()

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self, prefix: str, replica_prefix: str) -> dict[str, torch.Tensor]:
        """DCP-ready state: what every replica shares under ``prefix`` (global copy, outer
        momentum, cycle position), what differs per replica under ``replica_prefix`` (error
        feedback, and the local parameters, which differ inside a cycle while the model's own
        keys keep only one replica's shards). Tensors are shaped like the parameters (DTensors
        if they are), sharing storage with the state so that an in-place load fills it."""
        sd = {f"{prefix}cycle": torch.tensor([self.inner_steps, self.outer_steps], dtype=torch.int64)}
        sd.update(entries_state_dict(self.entries, prefix, replica_prefix))
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor], prefix: str, replica_prefix: str) -> None:
        missing = [k for k in self.state_dict_keys(prefix, replica_prefix) if k not in sd]
        if missing:
            raise KeyError(f"DiLoCo state missing from the checkpoint: {missing[:3]}{'...' if len(missing) > 3 else ''}")
        self.inner_steps, self.outer_steps = (int(x) for x in sd[f"{prefix}cycle"].tolist())
        load_entries(self.entries, sd, prefix, replica_prefix)
        self._tp.mirror()  # this replica's own local values, from their owner
        self.has_global = True

    def heal_state(self) -> dict:
        """For a replica rejoining over torchft (at a cycle's start): what the replicas share.
        Before the first cycle there is no global copy yet: the parameters (healed too) make it."""
        return {"outer_steps": self.outer_steps,
                "tensors": shared_copies(self.entries) if self.has_global else None}

    def load_heal_state(self, sd: dict) -> None:
        """From a live peer at a cycle's start: its global copy and momentum; a new cycle."""
        if sd["tensors"] is not None:
            load_shared_copies(self.entries, sd["tensors"])
        self._tp.mirror()
        self.outer_steps, self.inner_steps, self.has_global = sd["outer_steps"], 0, sd["tensors"] is not None

    def state_dict_keys(self, prefix: str, replica_prefix: str) -> list[str]:
        return [f"{prefix}cycle", *entry_keys(self.entries, prefix, replica_prefix)]


def _device_of(params) -> torch.device:
    return local_tensor(params[0]).device if params else torch.device("cpu")


