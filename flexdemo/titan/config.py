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

from flexdemo.run_settings import RunSettings
from flexdemo.section import FlexDemo, FlexDemoConfigError, check_section, replica_check_steps  # noqa: F401 (re-exported)

from .checks import validate_job_config  # noqa: F401 (re-exported)

# Set on the job config by flexdemo.titan.entry.FlexTrainer before torchtitan builds
# anything: each replica's loss is normalised by its own tokens, so parallelize
# does not rescale gradients and the metrics processor rescales the logged average loss.
REPLICA_LOCAL_LOSS_ATTR = "_flexdemo_replica_local_loss"


def replica_local_loss(job_config) -> bool:
    return bool(getattr(job_config, REPLICA_LOCAL_LOSS_ATTR, False))


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
