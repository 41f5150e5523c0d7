"""Entry point: ``python -m flexdemo.titan.run --job.config_file X.toml [--section.key v ...]``.

Same CLI as ``python -m torchtitan.train``.  Before torchtitan starts it
1. applies the CPU shim when there is no GPU (and only then),
2. parses and validates the config, so a bad config exits non-zero with one
   clear message before any process group or model exists.
Then it runs torchtitan's stock trainer main with flexdemo's FlexTrainer (torchtitan's
Trainer, whose per-step token count stays inside a replica: flexdemo/titan/trainer.py).
Replicas that disagree on a setting of the exchange (flexdemo.compression.agreement) end the
same way as a bad config: one line, exit code 2.
"""

import os
import sys
import time

from . import cpu_shim

CONFIG_ERROR_EXIT = 2
RANK0_GRACE_SECONDS = 3


def check_config(argv: list[str], world_size: int | None):
    """Parse like torchtitan does and run flexdemo's checks; raises on a bad config.
    Returns the parsed config."""
    from torchtitan.config import ConfigManager

    from .config import validate_job_config
    from .dataloader import check_tokenizer_available

    job_config = ConfigManager().parse_args(argv)
    if hasattr(job_config, "flexdemo"):
        validate_job_config(job_config, world_size)
        if world_size is not None:  # the checkpoint it resumes must fit its settings
            from .checkpoint_format import plan_resume
            from .config import FlexDemoConfigError

            p = job_config.parallelism
            replicas = p.data_parallel_replicate_degree
            shards = world_size // (replicas * p.tensor_parallel_degree * p.pipeline_parallel_degree)
            plan_resume(job_config, job_config.flexdemo, replicas, shards, FlexDemoConfigError)
    check_tokenizer_available(job_config)
    return job_config


def check_config_or_exit(argv: list[str], world_size: int | None):
    from .config import FlexDemoConfigError

    try:
        return check_config(argv, world_size)
    except FlexDemoConfigError as e:
        _exit_config_error(str(e))
    except (ValueError, FileNotFoundError) as e:  # torchtitan's own config errors
        _exit_config_error(f"config error: {e}")


def _exit_config_error(msg: str, process_group_up: bool = False) -> None:
    if process_group_up:
        # torchtitan's Trainer.__init__ is wrapped in torch elastic's @record, which has written this
        # rank's traceback for torchrun's summary: the one line below says it instead. Removed
        # first: torchrun stops the other ranks as soon as rank 0 exits.
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file and os.path.exists(error_file):
            os.remove(error_file)
    if os.environ.get("RANK", "0") == "0":  # one line per job, not one per rank
        print(f"flexdemo: {msg}", file=sys.stderr, flush=True)
    else:
        # torchrun stops the other ranks as soon as one exits: let rank 0 say why first.
        time.sleep(RANK0_GRACE_SECONDS)
    if process_group_up:
        cpu_shim.exit_without_teardown(CONFIG_ERROR_EXIT)  # no teardown: a live gloo thread can abort it
    sys.exit(CONFIG_ERROR_EXIT)


def check_stock_entry_or_exit() -> None:
    """Under torchtitan's own entry point (``torchrun -m torchtitan.train``) nothing of
    flexdemo runs before torchtitan has set up the process group -- except the
    ``custom_import`` module, which calls this: the run's own arguments are checked
    there, so a bad config ends every rank with one line and exit code 2, before any
    collective. Other entry points check for themselves (``main`` below, preflight)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or spec.name != "torchtitan.train":
        return
    world = os.environ.get("WORLD_SIZE")
    check_config_or_exit(sys.argv[1:], int(world) if world else None)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if cpu_shim.needed():
        cpu_shim.apply()
    world = os.environ.get("WORLD_SIZE")
    check_config_or_exit(argv, int(world) if world else None)

    from torchtitan.train import main as titan_main

    from flexdemo.compression.agreement import ReplicaSettingsMismatch
    from flexdemo.elastic.group import ElasticJoinError

    from .trainer import FlexTrainer

    sys.argv = [sys.argv[0], *argv]
    try:
        titan_main(FlexTrainer)
    except (ReplicaSettingsMismatch, ElasticJoinError) as e:  # before training, every rank alike: one line, exit 2
        _exit_config_error(str(e), process_group_up=True)
    if cpu_shim.active():
        cpu_shim.exit_without_teardown(0)  # errors never get here: they raise out of titan_main


if __name__ == "__main__":
    main()
