"""The cross-section checks of a flexdemo run's config (the [flexdemo] section's own are
flexdemo.section's): torchtitan-free, read through 0.2.2's section names, which the 0.3.0 adapter
shows its config under (flexdemo.titan.v0_3.legacy). flexdemo.titan.config re-exports them."""

from flexdemo.data.dataset import is_embedded_dataset
from flexdemo.modes import mode_of
from flexdemo.section import FlexDemo, check_section, replica_check_steps
from flexdemo.section import fail as _fail

from .elastic import check_elastic


def _non_dp_degree(p) -> int:
    """Ranks of one data-parallel slot: tensor x pipeline x context parallel."""
    return p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree


def validate_job_config(job_config, world_size: int | None) -> None:
    """Cross-section checks; raises FlexDemoConfigError with one clear message."""
    c: FlexDemo = job_config.flexdemo
    check_section(c)
    # "auto" becomes its number here, so that every reader of the section (the optimizer builder,
    # which runs after this check in every rank) sees steps.
    c.replica_check_interval = replica_check_steps(c)
    p = job_config.parallelism
    non_dp = _non_dp_degree(p)
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


def check_heldout_layout(job_config, world_size: int) -> None:
    """Where the world size is known (the launchers' pre-flight, then each rank's check before
    torchtitan starts; not validate_job_config, which the planner calls: it may tokenize the
    held-out split): a validator of flexdemo's held-out split that could not read the same windows
    at this layout is refused in one line, not at its first validation."""
    from flexdemo.data.audit import check_layout

    v, p = job_config.validation, job_config.parallelism
    if not v.enable:
        return
    dp = world_size // _non_dp_degree(p)
    try:
        check_layout(v.dataset, v.dataset_path, job_config.model.hf_assets_path, v.seq_len, dp,
                     v.local_batch_size, v.steps)
    except ValueError as e:
        _fail(str(e))
