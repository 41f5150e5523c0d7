"""The version-independent part of flexdemo's optimizers container: what it does around
torchtitan's OptimizersContainer, whichever torchtitan version supplies that class (0.2.2:
flexdemo.titan.optimizer, 0.3.0: flexdemo.titan.v0_3.optimizer mix :class:`FlexContainer` in
before it). Around the optimizers' step it asks the run's replica sync (replica_sync: every step's
own exchange, or the DiLoCo outer step), finishes an overlapped exchange at the run's last step and
runs the periodic replica-identity check; it owns the byte meter (meters.ExchangeMeter) and its
part of a checkpoint (checkpoint.OptimizerCheckpoint)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.nn as nn
from torchtitan.tools.logging import logger

from flexdemo.compression.buckets import describe_blocks
from flexdemo.optim.diloco import DiLoCo
from flexdemo.replica_group import ReplicaGroup
from flexdemo.run_settings import RunSettings

from . import replicas as rep
from .checkpoint import OptimizerCheckpoint, Resume
from .meters import ExchangeMeter, SkippedSteps
from .replica_sync import EveryStep, OuterCycle


class FlexContainer:
    """Mixed in before a torchtitan OptimizersContainer; ``setup_flex`` runs once its optimizers exist."""

    def setup_flex(
        self,
        model_parts: list[nn.Module],
        *,
        replicate_group: ReplicaGroup | None,
        replica_check_interval: int,
        replica_check_action: str = "stop",
        modelled_bytes_per_step: int | None,
        per_replica_state: bool,
        run_settings: RunSettings,
        format_key: str,
        resume: Resume | None = None,
        outer: Callable[[list[torch.optim.Optimizer]], DiLoCo] | None = None,
        last_step: int | None = None,
        max_consecutive_skips: int = 0,
        job_replicas: int = 1,
        replica_index: int | None = None,
    ) -> None:
        self.last_step = last_step
        self.run_settings = run_settings
        self.replicate_group = replicate_group
        self.replica_check_interval = replica_check_interval
        self.replica_check_action = replica_check_action
        # This replica's place (its per-replica checkpoint keys): given (an elastic replica's
        # replica_id), or its rank in the dp_replicate group.
        self.replica = (replica_index if replica_index is not None
                        else replicate_group.rank() if replicate_group is not None else 0)
        self.step_count = 0
        # How the replicas stay in step, asked below and by elastic healing: the mode's outer
        # step built around the inner optimizers just made (flexdemo.modes), or every step's own.
        self.sync = (OuterCycle(outer(self.optimizers)) if outer is not None else EveryStep(
            self.optimizers, SkippedSteps(model_parts, self.optimizers, self.replica, last_step,
                                          max_consecutive_skips), modelled_bytes_per_step))
        compressors = [*(getattr(o, "compressor", None) for o in self.optimizers), self.sync.compressor]
        fused_kernels = any(c is not None and c.uses_fused_kernels for c in compressors)
        self.checkpoint = OptimizerCheckpoint(format_key, resume, self.replica,
                                              per_replica_state and replicate_group is not None, job_replicas)
        self.meter = ExchangeMeter(self.sync, fused_kernels)
        for c in compressors:  # every rank: its shard's blocks, which uneven shards make differ
            if c is not None:
                logger.info(f"flexdemo: {describe_blocks(c.buckets, c.encoding)}")
        names = {id(p): name for part in model_parts for name, p in part.named_parameters()}
        for opt in self.optimizers:
            if hasattr(opt, "param_names"):
                opt.param_names = names  # for messages that name a parameter

    def step(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        self.sync.before_step()
        super().step(*args, **kwargs)
        if self.last_step is not None and self.step_count + 1 == self.last_step:
            for opt in self._overlapped():
                opt.finish_pending()  # the run's last update is not left in flight
        self.sync.after_step()
        seconds = time.perf_counter() - start
        self.step_count += 1
        self.meter.account(seconds)
        self.sync.report(self.step_count)
        self.meter.note_kernel_compilation()
        # Validation makes the interval a multiple of sync_interval in the DiLoCo modes, so
        # the check always runs right after an outer step.
        if (
            self.replicate_group is not None
            and self.replica_check_interval
            and self.step_count % self.replica_check_interval == 0
        ):
            with self.consensus():
                rep.verify_or_resync(self.model_parts, self.replicate_group, self.step_count,
                                     self.replica_check_action, self.sync)

    def exchange_stats(self) -> dict[str, float]:
        """This rank's replica-exchange numbers, for the metrics processor (metrics.ExchangeMeter)."""
        return self.meter.stats(skipped_updates=self.sync.skipped_updates)

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint.save(
            super().state_dict(), step=self.step_count,
            byte_totals=(self.meter.bytes_sent_total, self.meter.bytes_received_total),
            sync=self.sync, overlapped=self._overlapped(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loaded = self.checkpoint.load(state_dict, sync=self.sync, overlapped=self._overlapped())
        super().load_state_dict(loaded.optimizers)
        if loaded.step is not None:
            self.step_count = loaded.step
            self.sync.resumed_at(loaded.step)
        if loaded.byte_totals is not None:
            self.meter.bytes_sent_total, self.meter.bytes_received_total = loaded.byte_totals

    def agreement_settings(self) -> list[tuple[str, str]]:
        """What the replicas' start-up agreement compared (every optimizer's and the outer step's
        settings that change the decoded bits), for an elastic replica's join to compare alike."""
        found = [(f"optimizer {i}", getattr(getattr(o, "compressor", None), "settings", None))
                 for i, o in enumerate(self.optimizers)]
        found.append(("outer step", self.sync.settings))
        return [(f"{who}: {k}", str(v)) for who, settings in found if settings for k, v in settings.items()]

    def _overlapped(self):
        return [o for o in self.optimizers if getattr(o, "overlap", False)]

    @contextlib.contextmanager
    def consensus(self):
        """The replicas' common parameters in the model for the duration (overlap_lookahead: the
        live ones hold each replica's own look-ahead; flexdemo.optim.lookahead)."""
        with contextlib.ExitStack() as stack:
            for opt in self._overlapped():
                stack.enter_context(opt.consensus())
            yield
