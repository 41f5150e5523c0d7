"""The optimizers of a flexdemo run: build_optimizers_fn of the flexdemo train specs, and the
torchtitan ``OptimizersContainer`` every mode returns. What each mode builds is its entry in
flexdemo.modes (DeMo; torchtitan's Adam/AdamW from [optimizer], with the DiLoCo outer step in
the DiLoCo modes); this module resolves [optimizer] and the replica group and hands them over.

The model is not changed here: parallelize.py made the replicas start identical and scaled their
gradients before this runs. Keys a config sets that its mode does not read are logged once as a
warning (:func:`ignored_keys`), so that nothing a user set is ignored silently.

:class:`FlexOptimizersContainer` keeps torchtitan's LR schedulers, DCP checkpoints (flattened
optimizer state dicts), step hooks and metrics working unchanged. Around the optimizers' step it
asks the run's replica sync (replica_sync: every step's own exchange, or the DiLoCo outer step),
finishes an overlapped exchange at the run's last step and runs the periodic replica-identity
check; it owns the helpers that count the exchange's bytes (metrics.ExchangeMeter) and lay out
its part of a checkpoint (checkpoint.OptimizerCheckpoint).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import fields
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.job_config import Optimizer as _TitanOptimizer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.compression.buckets import describe_blocks
from flexdemo.modes import EVERY_MODE_KEYS, mode_of
from flexdemo.optim.diloco import DiLoCo
from flexdemo.local import local_tensor
from flexdemo.replica_group import ReplicaGroup, replica_group
from flexdemo.run_settings import RunSettings

from . import elastic
from . import replicas as rep
from .checkpoint import OptimizerCheckpoint, Resume, format_key, plan_resume
from .config import FlexDemo, FlexDemoConfigError, run_settings
from .metrics import ExchangeMeter, SkippedSteps, modelled_hsdp_allreduce_bytes
from .replica_sync import EveryStep, OuterCycle
from .torchtitan_workarounds import adam_class_and_kwargs


def build_flexdemo_optimizers(model_parts: list[nn.Module], parallel_dims: ParallelDims,
                              job_config) -> FlexOptimizersContainer:
    """The flexdemo train specs' optimizers for ``model_parts`` (their spec passes the job config:
    torchtitan_workarounds.with_job_config): the mode's builder (flexdemo.modes) in the container."""
    optimizer_config = job_config.optimizer
    settings = run_settings(job_config)  # what the replicas agree on: start-up, checkpoint tag, elastic join
    cfg, spec = settings.section, settings.mode
    # The one replica group of the run, made here once and handed down (a ReplicaGroup; None with
    # one replica): torchft's (replicas are separate jobs, the Lighthouse decides who takes part)
    # or a static one over this job's dp_replicate group.
    process_group = rep.replicate_group(parallel_dims)
    group = None if process_group is None else replica_group(process_group)
    replicas, shards = parallel_dims.dp_replicate, parallel_dims.dp_shard * parallel_dims.cp
    checkpoint = {
        "format_key": format_key(settings.checkpoint_tag, replicas, shards),
        "resume": plan_resume(job_config, settings, replicas, shards, FlexDemoConfigError),
        "job_replicas": replicas,
    }
    if elastic.enabled(job_config):
        group = elastic.elastic_group(job_config)
        checkpoint["replica_index"] = job_config.fault_tolerance.replica_id  # stable whoever is alive
    ignored = ignored_keys(job_config)
    if ignored:
        logger.warning(f"flexdemo: mode={cfg.mode} does not use {', '.join(ignored)} (set in the config; ignored)")
    if group is not None:  # every setting at once, before the optimizers compare their own
        settings.agree(group, local_tensor(next(model_parts[0].parameters())).device)
    inner = adam_class_and_kwargs(optimizer_config, cfg.mode) if spec.inner_optimizer else None
    try:
        built = spec.build(model_parts, cfg, group, inner, lr=optimizer_config.lr, steps=job_config.training.steps,
                           replicas=parallel_dims.dp_replicate, inner_name=optimizer_config.name)
    except ValueError as e:
        raise FlexDemoConfigError(str(e)) from e
    # Modes that keep replicas apart had them start identical and their gradients scaled to replica
    # means in parallelize.py (keep_replicas_apart); HSDP's all-reduce bytes are modelled for the log.
    modelled = None if spec.separate_replicas else modelled_hsdp_allreduce_bytes(
        model_parts, parallel_dims, TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce])
    return FlexOptimizersContainer(
        model_parts, built.optimizer_cls, built.optimizer_kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=modelled,
        per_replica_state=built.per_replica_state,
        run_settings=settings,
        outer=built.outer,
        **checkpoint,
        **built.container_kwargs,
    )


def ignored_keys(job_config) -> list[str]:
    """``section.key`` of every key set to a non-default value that the chosen mode does not read."""
    c: FlexDemo = job_config.flexdemo
    spec = mode_of(c)
    used = {*EVERY_MODE_KEYS, *spec.reads}
    out = [f"flexdemo.{f.name}" for f in fields(FlexDemo)
           if f.name not in used and getattr(c, f.name) != f.default]
    defaults = _TitanOptimizer()
    out += [f"optimizer.{k}" for k in spec.ignores_optimizer_keys
            if getattr(job_config.optimizer, k) != getattr(defaults, k)]
    return out


class FlexOptimizersContainer(OptimizersContainer):
    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type,
        optimizer_kwargs: dict[str, Any],
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
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs)
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
