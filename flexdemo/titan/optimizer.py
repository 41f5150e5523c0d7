"""The optimizers of a flexdemo run: build_optimizers_fn of the flexdemo train specs, and the
torchtitan ``OptimizersContainer`` every mode returns.

mode "demo":        DeMo on every model part (FSDP-sharded DTensor params; DeMo exchanges
                    compressed momentum over dp_replicate inside step()).
mode "diloco" /
mode "demo_diloco": torchtitan's Adam/AdamW from [optimizer] inside each replica, and the
                    DiLoCo outer step (dense / DCT top-k compressed) every sync_interval steps.
mode "off":         torchtitan's Adam/AdamW from [optimizer]; replicas are kept equal by HSDP.

The model is not changed here: parallelize.py made the replicas start identical and scaled their
gradients before this runs. Keys a config sets that its mode does not read are logged once as a
warning (:func:`ignored_keys`), so that nothing a user set is ignored silently.

:class:`FlexOptimizersContainer` keeps torchtitan's LR schedulers, DCP checkpoints (flattened
optimizer state dicts), step hooks and metrics working unchanged. Around the optimizers' step it
adds the DiLoCo outer step (diloco, demo_diloco), finishing an overlapped exchange at the run's
last step and the periodic replica-identity check; it owns the helpers that count the exchange's
bytes (metrics.ExchangeMeter), report skipped updates (metrics.SkippedUpdates) and lay out its
part of a checkpoint (checkpoint.OptimizerCheckpoint).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import fields
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.config.job_config import Optimizer as _TitanOptimizer
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.compression.buckets import describe_blocks
from flexdemo.optim.diloco import DiLoCo

from . import elastic
from . import replicas as rep
from .checkpoint import OptimizerCheckpoint, Resume, format_key, format_tag, plan_resume
from .config import DILOCO_MODES, FlexDemo, FlexDemoConfigError, flexdemo_section
from .metrics import ExchangeMeter, SkippedUpdates, modelled_hsdp_allreduce_bytes
from .torchtitan_workarounds import adam_class_and_kwargs


def build_flexdemo_optimizers(model_parts: list[nn.Module], parallel_dims: ParallelDims,
                              job_config) -> FlexOptimizersContainer:
    """The flexdemo train specs' optimizers for ``model_parts`` (their spec passes the job config:
    torchtitan_workarounds.with_job_config)."""
    optimizer_config = job_config.optimizer
    cfg = flexdemo_section(job_config)
    group = rep.replicate_group(parallel_dims)
    replicas, shards = parallel_dims.dp_replicate, parallel_dims.dp_shard * parallel_dims.cp
    checkpoint = {
        "format_key": format_key(format_tag(cfg), replicas, shards),
        "resume": plan_resume(job_config, cfg, replicas, shards, FlexDemoConfigError),
        "job_replicas": replicas,
    }
    # The one place the replica group is chosen: torchft's (replicas are separate jobs, the
    # Lighthouse decides who takes part) or this job's dp_replicate group.
    if elastic.enabled(job_config):
        group = elastic.elastic_group(job_config)
        checkpoint["replica_index"] = job_config.fault_tolerance.replica_id  # stable whoever is alive
    ignored = ignored_keys(job_config)
    if ignored:
        logger.warning(f"flexdemo: mode={cfg.mode} does not use {', '.join(ignored)} (set in the config; ignored)")

    if cfg.mode == "off":
        cls, kwargs = adam_class_and_kwargs(optimizer_config, cfg.mode)
        modelled = modelled_hsdp_allreduce_bytes(
            model_parts, parallel_dims, TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
        )
        logger.info(f"flexdemo: mode=off, {optimizer_config.name} + stock HSDP")
        return _container(model_parts, cls, kwargs, cfg, group, checkpoint, modelled_bytes_per_step=modelled,
                          per_replica_state=False)  # HSDP keeps AdamW state identical across replicas

    # Every other mode keeps replicas apart: parallelize.py made them start identical and
    # scaled their gradients to replica means (keep_replicas_apart).
    if cfg.mode in DILOCO_MODES:
        steps = job_config.training.steps
        if steps % cfg.sync_interval:
            logger.warning(
                f"flexdemo: training.steps={steps} is not a multiple of sync_interval={cfg.sync_interval}: "
                f"the last {steps % cfg.sync_interval} steps end without an outer step, and the model "
                "saved last is each replica's own local one"
            )
        return _build_diloco(model_parts, optimizer_config, parallel_dims, cfg, group, checkpoint)

    from flexdemo.optim import DeMo

    kwargs = {
        "lr": optimizer_config.lr,
        "compression_decay": cfg.decay,
        "compression_topk": cfg.topk,
        "compression_chunk": cfg.chunk,
        "weight_decay": cfg.weight_decay,
        "replicate_group": group,
        "value_encoding": cfg.value_encoding,
        "overlap": cfg.overlap,
        "lookahead": cfg.overlap_lookahead,
        "kernel_precision": cfg.kernel_precision,
        "exchange_timeout": cfg.exchange_timeout_seconds or None,
        "nonfinite": cfg.nonfinite,
        "exchange": cfg.exchange,
        "sharded_topk": cfg.sharded_topk,
        "index_coding": cfg.index_coding,
        "momentum_dtype": cfg.momentum_dtype,
        "momentum_device": cfg.momentum_device,
    }
    logger.info(
        f"flexdemo: DeMo(topk={cfg.topk}, chunk={cfg.chunk}, decay={cfg.decay}, "
        f"values={cfg.value_encoding}, momentum={cfg.momentum_dtype} on {cfg.momentum_device}, "
        f"overlap={cfg.overlap}{', lookahead' if cfg.overlap_lookahead else ''}, "
        f"exchange={describe_exchange(cfg, cfg.topk)}) "
        f"over dp_replicate={parallel_dims.dp_replicate}"
    )
    return _container(model_parts, DeMo, kwargs, cfg, group, checkpoint, per_replica_state=True,
                      last_step=job_config.training.steps, max_consecutive_skips=cfg.max_consecutive_skips)


def _build_diloco(model_parts, optimizer_config, parallel_dims: ParallelDims, cfg, group,
                  checkpoint: dict) -> FlexOptimizersContainer:
    if len(model_parts) != 1:  # validation rejects pipeline parallelism in these modes
        raise FlexDemoConfigError(f"mode={cfg.mode!r} needs one model part, got {len(model_parts)}")
    topk = cfg.mode == "demo_diloco"
    outer = DiLoCo(
        model_parts[0].named_parameters(),
        sync_interval=cfg.sync_interval,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        nesterov=cfg.outer_nesterov,
        compression="topk" if topk else "dense",
        value_encoding=cfg.outer_value_encoding,
        topk=cfg.outer_topk,
        chunk=cfg.outer_chunk,
        decay=cfg.outer_decay,
        replicate_group=group,
        state_device=cfg.outer_state_device,
        kernel_precision=cfg.kernel_precision,
        exchange_timeout=cfg.exchange_timeout_seconds or None,
        nonfinite=cfg.nonfinite,
        max_consecutive_skips=cfg.max_consecutive_skips,
        exchange=cfg.exchange,
        sharded_topk=cfg.sharded_topk,
        index_coding=cfg.index_coding,
        transform=cfg.outer_transform if topk else "dct",  # diloco: ignored, and said so (ignored_keys)
    )
    cls, kwargs = adam_class_and_kwargs(optimizer_config, cfg.mode)
    kind = "DCT" if cfg.outer_transform == "dct" else "raw-value"
    compression = (
        f"{kind} top-k (topk={cfg.outer_topk}, chunk={cfg.outer_chunk}, decay={cfg.outer_decay}, "
        f"exchange={describe_exchange(cfg, cfg.outer_topk)})" if topk else "dense"
    )
    logger.info(
        f"flexdemo: mode={cfg.mode}: {optimizer_config.name} inside each replica, outer step every "
        f"{cfg.sync_interval} steps over dp_replicate={parallel_dims.dp_replicate}: {compression}, "
        f"{cfg.outer_value_encoding} values, SGD lr={cfg.outer_lr} momentum={cfg.outer_momentum} "
        f"nesterov={cfg.outer_nesterov}, state on {cfg.outer_state_device} "
        f"({outer.state_bytes_per_param()} bytes/param)"
    )
    return _container(model_parts, cls, kwargs, cfg, group, checkpoint,
                      per_replica_state=True, outer=outer)  # each replica's AdamW state is its own


def _container(model_parts, cls: type, kwargs: dict, cfg, group, checkpoint: dict, *,
               per_replica_state: bool, modelled_bytes_per_step: int | None = None,
               **extra) -> FlexOptimizersContainer:
    """The optimizers container every mode returns: the replica group and check, its checkpoint
    keys, and the mode's own ``extra`` arguments."""
    return FlexOptimizersContainer(
        model_parts, cls, kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=modelled_bytes_per_step,
        per_replica_state=per_replica_state,
        **checkpoint,
        **extra,
    )


def describe_exchange(c: FlexDemo, topk: int) -> str:
    """The exchange for a log line: "allgather", or "sharded (top-N of the mean)"."""
    return "allgather" if c.exchange == "allgather" else f"sharded (top-{c.sharded_topk or topk} of the mean)"


# [flexdemo] keys each mode reads (mode itself and the replica check: all of them).
_DEMO_KEYS = ("topk", "chunk", "decay", "value_encoding", "weight_decay", "overlap", "kernel_precision",
              "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips", "exchange",
              "sharded_topk", "overlap_lookahead", "index_coding", "momentum_dtype",
              "momentum_device")
_OUTER_KEYS = ("sync_interval", "outer_lr", "outer_momentum", "outer_nesterov", "outer_value_encoding",
               "outer_state_device", "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips")
_KEYS_USED = {
    "demo": _DEMO_KEYS,
    "diloco": _OUTER_KEYS,
    "demo_diloco": (*_OUTER_KEYS, "outer_topk", "outer_chunk", "outer_decay", "outer_transform", "kernel_precision",
                    "exchange", "sharded_topk", "index_coding"),
    "off": (),
}
_KEYS_USED_BY_EVERY_MODE = ("mode", "replica_check_interval", "replica_check_action", "validation_same_batches",
                            "memory_check")
# [optimizer] keys that DeMo does not read (it takes lr, and [lr_scheduler] scales it).
_OPTIMIZER_KEYS_UNUSED_BY_DEMO = ("name", "beta1", "beta2", "eps", "weight_decay", "implementation")


def ignored_keys(job_config) -> list[str]:
    """``section.key`` of every key set to a non-default value that the chosen mode does not read."""
    c: FlexDemo = job_config.flexdemo
    used = {*_KEYS_USED_BY_EVERY_MODE, *_KEYS_USED[c.mode]}
    out = [f"flexdemo.{f.name}" for f in fields(FlexDemo)
           if f.name not in used and getattr(c, f.name) != f.default]
    if c.mode == "demo":
        defaults = _TitanOptimizer()
        out += [f"optimizer.{k}" for k in _OPTIMIZER_KEYS_UNUSED_BY_DEMO
                if getattr(job_config.optimizer, k) != getattr(defaults, k)]
    return out


class FlexOptimizersContainer(OptimizersContainer):
    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type,
        optimizer_kwargs: dict[str, Any],
        *,
        replicate_group,
        replica_check_interval: int,
        replica_check_action: str = "stop",
        modelled_bytes_per_step: int | None,
        per_replica_state: bool,
        format_key: str,
        resume: Resume | None = None,
        outer: DiLoCo | None = None,
        last_step: int | None = None,
        max_consecutive_skips: int = 0,
        job_replicas: int = 1,
        replica_index: int | None = None,
    ) -> None:
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs)
        self.outer = outer
        if outer is not None:
            outer.set_inner_optimizers(self.optimizers)  # a discarded cycle resets their state
        self.last_step = last_step
        self.replicate_group = replicate_group
        self.replica_check_interval = replica_check_interval
        self.replica_check_action = replica_check_action
        # This replica's place (its per-replica checkpoint keys): given (an elastic replica's
        # replica_id), or its rank in the dp_replicate group.
        self.replica = (replica_index if replica_index is not None
                        else dist.get_rank(replicate_group) if replicate_group is not None else 0)
        self.step_count = 0
        compressors = [getattr(o, "compressor", None) for o in self.optimizers]
        compressors.append(outer.compressor if outer is not None else None)
        fused_kernels = any(c is not None and c.uses_fused_kernels for c in compressors)
        self.checkpoint = OptimizerCheckpoint(format_key, resume, self.replica,
                                              per_replica_state and replicate_group is not None, job_replicas)
        self.meter = ExchangeMeter(self.optimizers, outer, modelled_bytes_per_step, fused_kernels)
        self.skips = SkippedUpdates(model_parts, self.optimizers, outer, self.replica, last_step,
                                    max_consecutive_skips)
        for c in compressors:  # every rank: its shard's blocks, which uneven shards make differ
            if c is not None:
                logger.info(f"flexdemo: {describe_blocks(c.buckets, c.encoding)}")
        names = {id(p): name for part in model_parts for name, p in part.named_parameters()}
        for opt in self.optimizers:
            if hasattr(opt, "param_names"):
                opt.param_names = names  # for messages that name a parameter

    def step(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        if self.outer is not None:
            self.outer.before_inner_step()
        super().step(*args, **kwargs)
        if self.last_step is not None and self.step_count + 1 == self.last_step:
            for opt in self._overlapped():
                opt.finish_pending()  # the run's last update is not left in flight
        synced = self.outer.after_inner_step() if self.outer is not None else False
        seconds = time.perf_counter() - start
        self.step_count += 1
        self.meter.account(seconds)
        self.skips.after_step(self.step_count)
        self.meter.note_kernel_compilation()
        if synced and not self.outer.last_sync_committed:
            logger.warning(f"flexdemo: the outer step after step {self.step_count} was not committed (an elastic "
                           "replica failed during the exchange): nothing applied, the cycle goes on")
        elif synced:
            logger.info(
                f"flexdemo: outer step {self.outer.outer_steps} after step {self.step_count} "
                f"({self.outer.compression}, {self.meter.last_bytes_sent} bytes sent, "
                f"{self.meter.last_bytes_received} received over dp_replicate, "
                f"{1e3 * self.outer.last_sync_seconds:.1f} ms)"
            )
        # Validation makes the interval a multiple of sync_interval in the DiLoCo modes, so
        # the check always runs right after an outer step.
        if (
            self.replicate_group is not None
            and self.replica_check_interval
            and self.step_count % self.replica_check_interval == 0
        ):
            with self.consensus():
                rep.verify_or_resync(self.model_parts, self.replicate_group, self.step_count,
                                     self.replica_check_action, self.outer)

    def exchange_stats(self) -> dict[str, float]:
        """This rank's replica-exchange numbers, for the metrics processor (metrics.ExchangeMeter)."""
        return self.meter.stats(skipped_updates=self.skips.count)

    def state_dict(self) -> dict[str, Any]:
        return self.checkpoint.save(
            super().state_dict(), step=self.step_count,
            byte_totals=(self.meter.bytes_sent_total, self.meter.bytes_received_total),
            outer=self.outer, overlapped=self._overlapped(),
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        loaded = self.checkpoint.load(state_dict, outer=self.outer, overlapped=self._overlapped())
        super().load_state_dict(loaded.optimizers)
        if loaded.step is not None:
            self.step_count = self.skips.counted_through = loaded.step
        if loaded.byte_totals is not None:
            self.meter.bytes_sent_total, self.meter.bytes_received_total = loaded.byte_totals

    def agreement_settings(self) -> list[tuple[str, str]]:
        """What the replicas' start-up agreement compared (every optimizer's and the outer step's
        settings that change the decoded bits), for an elastic replica's join to compare alike."""
        found = [(f"optimizer {i}", getattr(getattr(o, "compressor", None), "settings", None))
                 for i, o in enumerate(self.optimizers)]
        found.append(("outer step", self.outer.settings if self.outer is not None else None))
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
