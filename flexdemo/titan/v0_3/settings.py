"""What the replicas of a 0.3.0 run agree on (flexdemo.run_settings) and the config checks
(flexdemo.titan.checks, read through the 0.2.2 names: legacy.py) -- the 0.3.0 side of 0.2.2's
flexdemo.titan.config."""

from __future__ import annotations

from flexdemo.run_settings import RunSettings

from ..checks import validate_job_config
from .legacy import legacy_view

# (path in the 0.3.0 config, attribute) every replica must share besides all of [flexdemo]; named
# by 0.2.2's keys where one exists, so the list reads alike on both versions.
SHARED = (
    ("model.flavor", lambda c: c.model_spec.flavor if c.model_spec else None),
    ("training.dataset", lambda c: getattr(c.dataloader, "dataset", None)),
    ("training.seq_len", lambda c: c.training.seq_len),
    ("training.local_batch_size", lambda c: c.training.local_batch_size),
    ("training.global_batch_size", lambda c: c.training.global_batch_size),
    ("training.steps", lambda c: c.training.steps),
    ("training.max_norm", lambda c: c.training.max_norm),
    ("training.mixed_precision_param", lambda c: c.training.mixed_precision_param),
    ("optimizer.param_groups", lambda c: [(g.optimizer_name, sorted(g.optimizer_kwargs.items()))
                                          for g in c.optimizer.param_groups]),
    ("lr_scheduler", lambda c: (c.lr_scheduler.warmup_steps, c.lr_scheduler.decay_ratio,
                                c.lr_scheduler.decay_type, c.lr_scheduler.min_lr_factor)),
    ("parallelism", lambda c: (c.parallelism.data_parallel_shard_degree, c.parallelism.tensor_parallel_degree,
                               c.parallelism.context_parallel_degree)),
    # elastic replicas (0.3.0's TorchFTManager.Config, 0.2.2's names); replica_id is each one's own
    ("fault_tolerance.group_size", lambda c: c.fault_tolerance.group_size),
    ("fault_tolerance.min_replica_size", lambda c: c.fault_tolerance.min_replica_size),
    ("fault_tolerance.process_group", lambda c: c.fault_tolerance.process_group),
)


def run_settings(config) -> RunSettings:
    return RunSettings(config.flexdemo, tuple((name, repr(get(config))) for name, get in SHARED))


def validate(config, world_size: int | None) -> None:
    """flexdemo's checks of a 0.3.0 config; FlexDemoConfigError with one clear message. Also pins
    what flexdemo needs of 0.3.0 (the partial_dtensor backend: meshes named as 0.2.2's)."""
    from flexdemo.section import fail

    if config.parallelism.spmd_backend != "partial_dtensor":
        fail(f"parallelism.spmd_backend={config.parallelism.spmd_backend!r}: flexdemo needs \"partial_dtensor\" "
             "(FSDP on the fsdp sub-mesh of a replica; the other backends run on torch >= 2.14 only)")
    from flexdemo.data.tokenizer import has_tokenizer

    if config.hf_assets_path and not has_tokenizer(config.hf_assets_path):
        fail(f"[model] hf_assets_path {config.hf_assets_path!r} holds no tokenizer, which dataset "
             f"{getattr(config.dataloader, 'dataset', '?')!r} needs")
    validate_job_config(legacy_view(config), world_size)
