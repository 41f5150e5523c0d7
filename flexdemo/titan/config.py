"""`[flexdemo]` section for torchtitan 0.2.2 TOML configs.

Enable with ``[job] custom_config_module = "flexdemo.titan.config"``.  torchtitan
merges this ``JobConfig`` into its own, so ``--flexdemo.topk 16`` works on the CLI
and unknown ``[flexdemo]`` keys are rejected by torchtitan's config loader.

Per-field checks run when the section is built; checks that need other sections
or the world size live in ``validate_job_config`` (called before training starts).
"""

# No `from __future__ import annotations`: torchtitan's config merger needs real types.
from dataclasses import dataclass, field

from torchtitan.config.job_config import JobConfig as _TitanJobConfig

MODES = ("demo", "off")
VALUE_ENCODINGS = ("fp32", "bf16", "sign")
INIT_SYNC = ("broadcast", "verify", "none")


class FlexDemoConfigError(ValueError):
    """A bad flexdemo/torchtitan configuration, detected before training."""


@dataclass
class FlexDemo:
    mode: str = "demo"
    """"demo": FSDP inside a replica + DeMo compressed exchange across replicas.
    "off": torchtitan's stock HSDP + [optimizer] (AdamW) baseline, same launcher."""

    topk: int = 32
    """Coefficients kept per DCT block (per replica, per step)."""

    chunk: int = 64
    """Target DCT block edge; each dim uses its largest divisor <= chunk."""

    decay: float = 0.999
    """Momentum decay (beta) of the DeMo momentum."""

    value_encoding: str = "sign"
    """How kept coefficient values travel: "fp32", "bf16" or "sign" (1 bit)."""

    weight_decay: float = 0.0
    """Decoupled weight decay used by DeMo (the [optimizer] weight_decay is for mode "off")."""

    replica_check_interval: int = 0
    """Every N steps verify that all replicas hold bit-identical parameters (0 = never)."""

    init_sync: str = "broadcast"
    """At start: "broadcast" params from replica 0, "verify" they match, or "none"."""

    def __post_init__(self) -> None:
        check_section(self)


def _fail(msg: str) -> None:
    raise FlexDemoConfigError(f"[flexdemo] config error: {msg}")


def check_section(c: FlexDemo) -> None:
    """Checks that need only the [flexdemo] section itself."""
    if c.mode not in MODES:
        _fail(f"mode={c.mode!r}; expected one of {MODES}")
    if c.value_encoding not in VALUE_ENCODINGS:
        _fail(f"value_encoding={c.value_encoding!r}; expected one of {VALUE_ENCODINGS}")
    if c.init_sync not in INIT_SYNC:
        _fail(f"init_sync={c.init_sync!r}; expected one of {INIT_SYNC}")
    if not isinstance(c.chunk, int) or c.chunk < 1:
        _fail(f"chunk={c.chunk!r}; expected an integer >= 1")
    if not isinstance(c.topk, int) or c.topk < 1:
        _fail(f"topk={c.topk!r}; expected an integer >= 1")
    if c.topk > c.chunk * c.chunk:
        _fail(
            f"topk={c.topk} is larger than a chunk*chunk block "
            f"({c.chunk}*{c.chunk}={c.chunk * c.chunk})"
        )
    if not 0.0 <= float(c.decay) < 1.0:
        _fail(f"decay={c.decay!r}; expected 0 <= decay < 1")
    if float(c.weight_decay) < 0.0:
        _fail(f"weight_decay={c.weight_decay!r}; expected >= 0")
    if not isinstance(c.replica_check_interval, int) or c.replica_check_interval < 0:
        _fail(f"replica_check_interval={c.replica_check_interval!r}; expected an integer >= 0")


def validate_job_config(job_config, world_size: int | None) -> None:
    """Cross-section checks; raises FlexDemoConfigError with one clear message."""
    c: FlexDemo = job_config.flexdemo
    check_section(c)
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
    if job_config.optimizer.early_step_in_backward:
        _fail("optimizer.early_step_in_backward is not supported by the flexdemo train specs")
    if c.mode != "demo":
        return
    if world_size is not None and world_size > 1 and p.data_parallel_replicate_degree < 2:
        _fail(
            "mode='demo' needs parallelism.data_parallel_replicate_degree >= 2 (DeMo exchanges "
            "across replicas); use mode='off' for a single replica"
        )
    unsupported = {
        "tensor_parallel_degree": p.tensor_parallel_degree,
        "pipeline_parallel_degree": p.pipeline_parallel_degree,
        "context_parallel_degree": p.context_parallel_degree,
        "expert_parallel_degree": p.expert_parallel_degree,
    }
    bad = [f"{k}={v}" for k, v in unsupported.items() if v != 1]
    if bad:
        _fail(
            f"mode='demo' supports data parallelism only (FSDP inside a replica, DeMo across "
            f"replicas); got parallelism.{', parallelism.'.join(bad)}. Use mode='off' for TP/PP/CP/EP."
        )
    if job_config.fault_tolerance.enable:
        _fail("mode='demo' does not support fault_tolerance.enable")


@dataclass
class JobConfig(_TitanJobConfig):
    """torchtitan's JobConfig plus the [flexdemo] section."""

    flexdemo: FlexDemo = field(default_factory=FlexDemo)


def flexdemo_section(job_config) -> FlexDemo:
    """The [flexdemo] section, with a clear error when the config module was not loaded."""
    section = getattr(job_config, "flexdemo", None)
    if section is None:
        raise FlexDemoConfigError(
            "[flexdemo] section missing: set [job] custom_config_module = \"flexdemo.titan.config\""
        )
    return section
