"""A rank of a flexdemo run on torchtitan 0.3.0 (0.2.2: flexdemo.titan.entry): the CPU shim where
there is no GPU, the config (a flexdemo TOML through toml_config, or torchtitan's
``--module/--config``), then what torchtitan.train.main does with it. A bad config ends every rank
with one line and exit code 2, before any process group exists (FlexTrainer checks it first)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback

from flexdemo.compression.agreement import ReplicaSettingsMismatch
from flexdemo.elastic.group import ElasticJoinError
from flexdemo.section import FlexDemoConfigError

from . import cpu_shim

CONFIG_ERROR_EXIT = 2


def parse(argv: list[str]):
    """The FlexTrainer.Config of a rank's arguments."""
    if "--job.config_file" in argv:
        i = argv.index("--job.config_file")
        from .toml_config import read

        return read(argv[i + 1], argv[:i] + argv[i + 2:])
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(argv)


def check(argv: list[str], world_size: int | None):
    """Parse and check once (the launcher, before any rank starts); raises FlexDemoConfigError. With
    the world size, also the checkpoint it resumes against its settings and layout (as 0.2.2's
    check_config: flexdemo.titan.checkpoint.plan_resume; another layout resumes, a data position
    that cannot be resharded is refused here)."""
    from .settings import validate

    config = parse(argv)
    validate(config, world_size)
    if world_size is not None:
        from ..checkpoint import check_resume_for_world
        from ..checks import check_heldout_layout
        from .legacy import legacy_view
        from .settings import run_settings

        legacy = legacy_view(config)
        check_resume_for_world(legacy, run_settings(config), world_size, FlexDemoConfigError)
        check_heldout_layout(legacy, world_size)  # (0.3.0 builds its loader at each validation)
    return config


def say_config_error(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # one line per job, not one per rank
        print(f"flexdemo: {msg}", file=sys.stderr, flush=True)
    else:
        time.sleep(3)  # torchrun stops the others as soon as one exits: let rank 0 say why first


def run(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cpu_shim.apply()
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = None
    try:
        config = parse(argv)
        trainer = config.build()
        trainer.train()
    except (FlexDemoConfigError, ReplicaSettingsMismatch, ElasticJoinError) as e:
        group_up = trainer is not None or torch.distributed.is_initialized()
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if group_up and error_file and os.path.exists(error_file):
            # torchtitan's Trainer.__init__/train are wrapped in torch elastic's @record, which has
            # written this rank's traceback for torchrun's summary: the one line below says it instead.
            os.remove(error_file)
        say_config_error(str(e))
        if group_up:
            cpu_shim.exit_without_teardown(CONFIG_ERROR_EXIT) if cpu_shim.active() else os._exit(CONFIG_ERROR_EXIT)
        sys.exit(CONFIG_ERROR_EXIT)
    except Exception:
        if multiprocessing.parent_process() is not None:  # forked rank: its log shows the traceback too
            traceback.print_exc()
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if cpu_shim.active() and multiprocessing.parent_process() is None:
        cpu_shim.exit_without_teardown(0)  # a finished gloo process: no teardown (flexdemo.titan.cpu_shim)
