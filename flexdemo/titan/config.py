"""`[flexdemo]` section for torchtitan 0.2.2 TOML configs (its keys: flexdemo.section.FlexDemo).

Enable with ``[job] custom_config_module = "flexdemo.titan.config"``.  torchtitan
merges this ``JobConfig`` into its own, so ``--flexdemo.topk 16`` works on the CLI
and unknown ``[flexdemo]`` keys are rejected by torchtitan's config loader.

``validate_job_config`` checks values, also those that come from TOML (which tyro takes
as they are), and everything that needs other sections or the world size; it runs once
before any rank starts (scripts/launch.sh, ``flexdemo.titan.run``, or, under torchtitan's
own entry point, when torchtitan imports ``flexdemo.titan.register``).
"""

# No `from __future__ import annotations`: torchtitan's config merger needs real types.
from dataclasses import dataclass, field

from torchtitan.config.job_config import JobConfig as _TitanJobConfig

from flexdemo.data.dataset import is_embedded_dataset
from flexdemo.modes import mode_of
from flexdemo.run_settings import RunSettings
from flexdemo.section import FlexDemo, FlexDemoConfigError, check_section, replica_check_steps  # noqa: F401 (re-exported)
from flexdemo.section import fail as _fail

from .elastic import check_elastic

# Set on the job config by flexdemo.titan.entry.FlexTrainer before torchtitan builds
# anything: each replica's loss is normalised by its own tokens, so parallelize
# does not rescale gradients and the metrics processor rescales the logged average loss.
REPLICA_LOCAL_LOSS_ATTR = "_flexdemo_replica_local_loss"


def replica_local_loss(job_config) -> bool:
    return bool(getattr(job_config, REPLICA_LOCAL_LOSS_ATTR, False))


def validate_job_config(job_config, world_size: int | None) -> None:
    """Cross-section checks; raises FlexDemoConfigError with one clear message."""
    c: FlexDemo = job_config.flexdemo
    check_section(c)
    # "auto" becomes its number here, so that every reader of the section (the optimizer builder,
    # which runs after this check in every rank) sees steps.
    c.replica_check_interval = replica_check_steps(c)
    p = job_config.parallelism
    non_dp = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    if world_size is not None:
        rep = p.data_parallel_replicate_degree
        if rep < 1 or world_size % (rep * non_dp) != 0:
            _fail(
                f"parallelism.data_parallel_replicate_degree={rep} (x tp*pp*cp={non_dp}) "
                f"does not divide the world size {world_size}"
            )
        shard = p.data_parallel_shard_degree
        if shard != -1 and rep * shard * non_dp != world_size:
            _fail(
                f"replicate({rep}) x shard({shard}) x tp*pp*cp({non_dp}) != world size {world_size}"
            )
    lr, spec = job_config.optimizer.lr, mode_of(c)
    if spec.lr_is_step_size and not (isinstance(lr, (int, float)) and 0.0 < float(lr) < float("inf")):
        _fail(f"optimizer.lr={lr!r}; mode '{c.mode}' needs a finite lr > 0 (the size of DeMo's sign step)")
    if job_config.optimizer.early_step_in_backward:
        _fail("optimizer.early_step_in_backward is not supported by the flexdemo train specs")
    if job_config.validation.enable and not c.validation_same_batches and is_embedded_dataset(job_config.validation.dataset):
        _fail(f"validation_same_batches=false with [validation] dataset {job_config.validation.dataset!r}: flexdemo's "
              "held-out splits are read as the same fixed windows at every validation (docs/data.md); remove the "
              "key, or validate on another dataset")
    if job_config.fault_tolerance.enable:
        check_elastic(job_config, _fail)
    if not spec.separate_replicas:
        if p.tensor_parallel_degree > 1 and p.data_parallel_replicate_degree > 1 and p.data_parallel_shard_degree == 1:
            _fail(
                f"mode='off' with parallelism.tensor_parallel_degree={p.tensor_parallel_degree} and "
                f"data_parallel_replicate_degree={p.data_parallel_replicate_degree} needs "
                "data_parallel_shard_degree >= 2: with one shard torchtitan replicates through DDP, which "
                "does not take tensor parallelism (flexdemo's own modes do)"
            )
        return
    elastic = job_config.fault_tolerance.enable  # replicas are other jobs
    if world_size is not None and world_size > 1 and p.data_parallel_replicate_degree < 2 and not elastic:
        _fail(
            f"mode={c.mode!r} needs parallelism.data_parallel_replicate_degree >= 2 (it exchanges "
            "across replicas); use mode='off' for a single replica"
        )
    # Inside a replica: FSDP and tensor parallelism (each rank exchanges its own local shard with
    # the ranks holding the same shard in the other replicas: the dp_replicate group).
    unsupported = {
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    bad = [f"{k}={v}" for k, v in unsupported.items() if v != 1]
    if bad:
        _fail(
            f"mode={c.mode!r} takes FSDP and tensor parallelism inside a replica (flexdemo's exchange "
            f"across replicas), not pipeline, context or expert parallelism; got "
            f"parallelism.{', parallelism.'.join(bad)}. Use mode='off' for PP/CP/EP."
        )
    if spec.outer is not None and c.replica_check_interval % c.sync_interval != 0:
        _fail(
            f"replica_check_interval={c.replica_check_interval} must be a multiple of "
            f"sync_interval={c.sync_interval} in mode={c.mode!r}: replicas are identical only right "
            "after an outer step"
        )


@dataclass
class JobConfig(_TitanJobConfig):
    """torchtitan's JobConfig plus the [flexdemo] section."""

    flexdemo: FlexDemo = field(default_factory=FlexDemo)


# (section, keys) of a torchtitan 0.2.2 job config that every replica must share, besides all of
# [flexdemo] (flexdemo.run_settings). Per-replica settings (replica_id, folders, logging) are not.
SHARED_KEYS = (
    ("model", ("name", "flavor")),
    ("training", ("dataset", "seq_len", "local_batch_size", "global_batch_size", "steps", "max_norm",
                  "mixed_precision_param", "mixed_precision_reduce")),
    ("optimizer", ("name", "lr", "eps", "weight_decay", "beta1", "beta2")),
    ("lr_scheduler", ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor")),
    ("parallelism", ("data_parallel_shard_degree", "tensor_parallel_degree", "context_parallel_degree")),
    ("fault_tolerance", ("group_size", "min_replica_size", "process_group")),
)


def run_settings(job_config) -> RunSettings:
    """What the replicas of this run must agree on (flexdemo.run_settings), made once per reader."""
    job = tuple((f"{section}.{k}", repr(getattr(getattr(job_config, section), k)))
                for section, keys in SHARED_KEYS for k in keys if hasattr(getattr(job_config, section), k))
    return RunSettings(flexdemo_section(job_config), job)


def flexdemo_section(job_config) -> FlexDemo:
    """The [flexdemo] section, with a clear error when the config module was not loaded."""
    section = getattr(job_config, "flexdemo", None)
    if section is None:
        raise FlexDemoConfigError(
            "[flexdemo] section missing: set [job] custom_config_module = \"flexdemo.titan.config\""
        )
    return section
