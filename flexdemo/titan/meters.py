"""The numbers of a run's replica exchange, independent of the torchtitan version: the byte meter
the optimizers container owns (:class:`ExchangeMeter`), the count of updates skipped for non-finite
gradients (:class:`SkippedSteps`), HSDP's modelled all-reduce bytes and the console line that
reports them (:func:`format_exchange_line`). flexdemo.titan.metrics (0.2.2) and
flexdemo.titan.v0_3.metrics report them through each torchtitan's metrics processor."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.tools.logging import logger

from flexdemo.compression.exchange import hsdp_allreduce_bytes
from flexdemo.local import local_tensor
from flexdemo.optim.nonfinite import RepeatedSkipsError, SkipStreak, describe_nonfinite


class ExchangeMeter:
    """Byte counters and timings of this rank's replica exchange, as the run's replica sync
    (flexdemo.titan.replica_sync) reports them: measured, or modelled for HSDP in mode off
    (FSDP does the comms, not flexdemo)."""

    def __init__(self, sync, fused_kernels: bool) -> None:
        self.sync = sync
        self.fused_kernels = fused_kernels
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self.last_bytes_sent = 0
        self.last_bytes_received = 0
        self.last_step_seconds = 0.0
        self._fused_step_seconds: list[float] = []

    def account(self, step_seconds: float) -> None:
        """The step that just ran, ``step_seconds`` long: its bytes."""
        self.last_step_seconds = step_seconds
        sent, received = self.sync.traffic()
        self.last_bytes_sent, self.last_bytes_received = sent, received
        self.bytes_sent_total += sent
        self.bytes_received_total += received

    def note_kernel_compilation(self) -> None:
        """The first exchange step compiles the fused Triton kernels (seconds); say so, and,
        at the next one, how long the compilation took. Triton keeps them on disk for later runs."""
        if not (self.fused_kernels and self.last_bytes_sent and len(self._fused_step_seconds) < 2):
            return
        from flexdemo.kernels import triton_cache_dir

        self._fused_step_seconds.append(self.last_step_seconds)
        if len(self._fused_step_seconds) == 1:
            logger.info(
                f"flexdemo: the first exchange step took {self.last_step_seconds:.1f} s: it compiles the fused "
                f"Triton kernels (cached in {triton_cache_dir()} for later runs on this machine)"
            )
        else:
            first, second = self._fused_step_seconds
            logger.info(
                f"flexdemo: compiling the fused Triton kernels took about {max(first - second, 0.0):.1f} s "
                f"(first exchange step {first:.1f} s, the next {second:.2f} s)"
            )

    @property
    def last_exchange_seconds(self) -> float | None:
        """The last step's exchange time (None: not measured). On CUDA reading it waits for the
        exchange's end event, so it is read when asked (the metrics, at log steps), not after
        every step: that was a host sync per step, the GPU idle until the CPU caught up."""
        return self.sync.exchange_seconds()

    def stats(self, skipped_updates: int) -> dict[str, float]:
        """Replica-dimension traffic of this rank, for the metrics processor. Bytes that were
        not measured (mode off: HSDP's all-reduce, modelled from the gradient size) carry
        their own names, ``*_modelled``, never those of measured bytes."""
        tag = "_modelled" if self.sync.bytes_modelled else ""
        stats = {
            f"replica_exchange/bytes_sent{tag}": self.last_bytes_sent,
            f"replica_exchange/bytes_received{tag}": self.last_bytes_received,
            f"replica_exchange/bytes_sent_total{tag}": self.bytes_sent_total,
            f"replica_exchange/bytes_received_total{tag}": self.bytes_received_total,
            "replica_exchange/optimizer_step(s)": self.last_step_seconds,
        }
        if not tag:  # flexdemo's own exchange: updates it skipped (DiLoCo modes: outer steps)
            stats["replica_exchange/skipped_steps"] = skipped_updates
        seconds = self.last_exchange_seconds
        if seconds is not None:
            stats["replica_exchange/exchange(s)"] = seconds
        outer_seconds = self.sync.last_sync_seconds
        if outer_seconds is not None:
            stats["replica_exchange/outer_step(s)"] = outer_seconds  # the last one
        return stats


def modelled_hsdp_allreduce_bytes(model_parts, parallel_dims: ParallelDims, reduce_dtype) -> int:
    """Bytes one rank sends (= receives) per step in HSDP's ring all-reduce over replicas."""
    r = parallel_dims.dp_replicate
    if r == 1:
        return 0
    shards = parallel_dims.dp_shard * parallel_dims.cp
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    numel = 0
    for part in model_parts:
        for p in part.parameters():
            if isinstance(p, DTensor):  # FSDP all-reduces the dim-0 padded shard
                rows = -(-p.shape[0] // shards) if p.dim() else 1
                numel += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
            else:
                numel += p.numel()
    return hsdp_allreduce_bytes(numel, r, elem)


class SkippedSteps:
    """Logs, counts and (``max_consecutive_skips``) stops on the steps whose update the optimizers
    of ``model_parts`` skipped on every replica for a non-finite gradient (mode demo). The DiLoCo
    modes' discarded cycles are DiLoCo's own to count and stop on (replica_sync.OuterCycle)."""

    def __init__(self, model_parts, optimizers, replica: int, last_step: int | None,
                 max_consecutive_skips: int) -> None:
        self.model_parts, self.optimizers, self.replica = model_parts, optimizers, replica
        self.last_step = last_step
        self.streak = SkipStreak(max_consecutive_skips)
        self._to_count: dict[int, set[int]] = {}  # skipped steps learned of, beyond the counted ones
        self.counted_through = 0  # every step up to this one is in the streak

    @property
    def count(self) -> int:
        """Steps skipped so far."""
        return self.streak.total + len(self._to_count)

    def after_step(self, step: int) -> None:
        """Report what step ``step`` (just run) and the steps before it were found to have skipped."""
        # DeMo learns of a skipped step without a host sync, so it may tell a step or so late
        # (at the run's last step it waits); steps are named by when they ran.
        last = self.last_step is not None and step == self.last_step
        skipped: dict[int, set[int]] = {}
        for o in self.optimizers:
            if hasattr(o, "pop_skipped_steps"):
                for ago, replicas in o.pop_skipped_steps(wait=last):
                    skipped.setdefault(step - ago, set()).update(replicas)
            elif getattr(o, "last_step_skipped_by", []):
                skipped.setdefault(step, set()).update(o.last_step_skipped_by)
        for ran, replicas in sorted(skipped.items()):
            self._to_count[ran] = replicas
            logger.warning(f"flexdemo: step {ran}'s update skipped on every replica: a non-finite "
                           f"gradient on replica(s) {sorted(replicas)} ({self.count} skipped so far)")
        # After step t every rank knows of every skipped step up to t - 1 (DeMo reads a step's
        # flags when the next one starts), of step t only maybe: counting up to t - 1 makes all
        # ranks stop at the same step (one stopping earlier would leave the others waiting in
        # the next exchange). The run's last step waited for its own flags.
        self._count_through(step if last else step - 1, step)

    def _count_through(self, through: int, step: int) -> None:
        for counted in range(self.counted_through + 1, through + 1):
            replicas = self._to_count.pop(counted, None)
            if replicas is None:
                self.streak.applied()
            else:
                self.streak.skipped(counted, {r: [] for r in replicas})
        self.counted_through = max(self.counted_through, through)
        if self.streak.over_limit:
            self._stop_repeated_skips(step)

    def _stop_repeated_skips(self, step: int) -> None:
        """Raise on every rank (all reach this at the same step) naming the replicas that flagged
        the skipped steps and, where this step's gradients are non-finite again, the parameters."""
        streak = self.streak.in_a_row
        first, last = streak[0][0], streak[-1][0]
        who = self._nonfinite_gradients()
        now = (f"; at step {step} non-finite gradients on {describe_nonfinite(who)}" if who
               else f"; step {step}'s gradients are finite")
        raise RepeatedSkipsError(
            f"flexdemo: {len(streak)} steps in a row ({first}..{last}) skipped on every replica "
            f"(max_consecutive_skips = {self.streak.limit}): a non-finite gradient on replica(s) "
            f"{self.streak.replicas()}{now}; the fault repeats (bad data? a diverging lr?): stopping"
        )

    def _nonfinite_gradients(self) -> dict[int, list[str]]:
        """Replica -> the parameters whose gradient (this step's, still in ``.grad``) is non-finite
        on any of its ranks, gathered from every rank. After gradient clipping one non-finite
        gradient makes all of that replica's non-finite (the clip factor is NaN)."""
        mine = [name for part in self.model_parts for name, p in part.named_parameters()
                if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all()]
        everyone = [(self.replica, mine)]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.replica, mine))
        order = {name: i for i, (name, _) in enumerate(self.model_parts[0].named_parameters())}
        who: dict[int, set[str]] = {}
        for replica, names in everyone:
            if names:
                who.setdefault(replica, set()).update(names)
        return {r: sorted(names, key=lambda n: order.get(n, len(order))) for r, names in who.items()}


def format_exchange_line(step: int, s: dict[str, Any]) -> str:
    """One parseable console line; byte counts are exact integers. Modelled (not measured)
    byte counts are named ``*_bytes_modelled``."""
    modelled = "replica_exchange/bytes_sent_modelled" in s
    tag = "_modelled" if modelled else ""
    line = (
        f"flexdemo step: {step:2}  "
        f"sent_bytes{tag}: {s[f'replica_exchange/bytes_sent{tag}']}  "
        f"received_bytes{tag}: {s[f'replica_exchange/bytes_received{tag}']}  "
        f"sent_bytes_total{tag}: {s[f'replica_exchange/bytes_sent_total{tag}']}  "
        f"received_bytes_total{tag}: {s[f'replica_exchange/bytes_received_total{tag}']}  "
        f"optimizer_step_ms: {1e3 * s['replica_exchange/optimizer_step(s)']:.1f}"
    )
    if modelled:
        return line + "  (modelled ring all-reduce of HSDP/DDP, mode=off)"
    line += f"  exchange_ms: {1e3 * s['replica_exchange/exchange(s)']:.1f}"
    if "replica_exchange/skipped_steps" in s:  # updates skipped for non-finite values, cumulative
        line += f"  skipped_steps: {s['replica_exchange/skipped_steps']}"
    return line
