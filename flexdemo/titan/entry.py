"""The ways into a flexdemo run: ``python -m flexdemo.titan.run`` (:func:`run`), the config check
the launcher (flexdemo.titan.launch) and every rank run (:func:`check_config_or_exit`), the check
under torchtitan's own entry point (:func:`check_stock_entry_or_exit`), and the Trainer they run
(:class:`FlexTrainer`).

``run``: ``python -m flexdemo.titan.run --job.config_file X.toml [--section.key v ...]``, the same
CLI as ``python -m torchtitan.train``. Before torchtitan starts it
1. applies the CPU shim when there is no GPU (and only then),
2. parses and validates the config, so a bad config exits non-zero with one
   clear message before any process group or model exists; rank 0 prints the memory estimate
   per GPU (``[flexdemo] memory_check``: a warning, or with "refuse" a config error, when it
   does not fit; flexdemo.titan.memory).
Then it runs torchtitan's stock trainer main with FlexTrainer. Replicas that disagree on a
setting of the exchange (flexdemo.compression.agreement) end the same way as a bad config: one
line, exit code 2.

``FlexTrainer``: torchtitan's Trainer with the per-step token count kept inside a replica.
torchtitan normalises each step's loss by the token count of the whole batch mesh, which
costs an all-reduce over every replica each step: a round trip over the slow link that the
modes keeping replicas apart (demo, diloco, demo_diloco) otherwise avoid. Here each
replica normalises by its own tokens (an all-reduce over its FSDP shards, or none), so every
replica's gradient is its own mean gradient, with no rescaling (flexdemo.titan.parallelize's
gradient scaling is then a factor 1), and the only per-step traffic between replicas is
flexdemo's exchange. Done through torchtitan's public extension point for trainers
(``torchtitan.train.main`` takes the Trainer class): the trainer's ParallelDims is shown through
a view whose "batch" is the replica's shard group (torchtitan_workarounds.ReplicaLocalBatch:
0.2.2 has no hook for that group). Logged losses stay global (flexdemo's metrics processor
rescales their average, see metrics.py). Under torchtitan's own entry point (the stock Trainer)
the all-reduce stays and the gradients are rescaled instead.
With ``[fault_tolerance] enable`` each replica is its own job and every step (in the DiLoCo
modes: every cycle) starts with torchft's quorum (flexdemo.titan.elastic).
With ``overlap_lookahead`` the validator is wrapped to score the replicas' common parameters
(metrics.ConsensusValidator); the stock Trainer would score each replica's look-ahead.
"""

import multiprocessing
import os
import sys
import time
import traceback

from torchtitan.config import ConfigManager
from torchtitan.train import Trainer
from torchtitan.train import main as titan_main

from flexdemo.compression.agreement import ReplicaSettingsMismatch
from flexdemo.elastic.group import ElasticJoinError
from flexdemo.modes import mode_of

from . import cpu_shim, elastic, memory
from .checkpoint import check_resume_for_world
from .checks import check_heldout_layout
from .config import REPLICA_LOCAL_LOSS_ATTR, FlexDemoConfigError, run_settings, validate_job_config
from .data import check_tokenizer_available, embedded_tokenizer_dir
from .metrics import ConsensusValidator
from .torchtitan_workarounds import replica_local_batch_view

CONFIG_ERROR_EXIT = 2
RANK0_GRACE_SECONDS = 3


def check_config(argv: list[str], world_size: int | None, memory_estimate: bool = True):
    """Parse like torchtitan does and run flexdemo's checks; raises on a bad config.
    Returns the parsed config."""
    job_config = ConfigManager().parse_args(argv)
    if hasattr(job_config, "flexdemo"):
        validate_job_config(job_config, world_size)
        if world_size is not None:  # the checkpoint it resumes must fit its settings, the held-out set its layout
            check_resume_for_world(job_config, run_settings(job_config), world_size, FlexDemoConfigError)
            check_heldout_layout(job_config, world_size)
    check_tokenizer_available(job_config)
    if memory_estimate and hasattr(job_config, "flexdemo"):
        check_memory(job_config, world_size)
    return job_config


def check_memory(job_config, world_size: int | None) -> None:
    """``[flexdemo] memory_check``: the estimate's line (once per job: the pre-flight, or rank 0),
    then a warning or (``"refuse"``) a FlexDemoConfigError when it is over the limit. Runs before
    any process group exists."""
    memory.check(job_config, world_size, _say)


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # one line per job, not one per rank
        print(line, file=sys.stderr, flush=True)


def check_config_or_exit(argv: list[str], world_size: int | None, memory_estimate: bool = True):
    try:
        return check_config(argv, world_size, memory_estimate)
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
    collective. Other entry points check for themselves (``run`` below, flexdemo.titan.launch)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or spec.name != "torchtitan.train":
        return
    world = os.environ.get("WORLD_SIZE")
    check_config_or_exit(sys.argv[1:], int(world) if world else None)


class FlexTrainer(Trainer):
    def __init__(self, job_config):
        flex = getattr(job_config, "flexdemo", None)
        local = flex is not None and mode_of(flex).separate_replicas
        setattr(job_config, REPLICA_LOCAL_LOSS_ATTR, local)
        super().__init__(job_config)
        if local and self.parallel_dims.dp_replicate > 1:
            self.parallel_dims = replica_local_batch_view(self.parallel_dims)
        # overlap_lookahead: validation scores the replicas' common parameters, not one's look-ahead.
        if getattr(self, "validator", None) is not None and flex is not None and flex.overlap_lookahead:
            self.validator = ConsensusValidator(self.validator, self.optimizers.consensus)
        # Elastic replicas (fault_tolerance.enable): torchft's quorum before every step (cycle); a replica
        # behind the others heals there from a live peer (flexdemo.titan.elastic).
        self.elastic_group = self.optimizers.replicate_group if elastic.enabled(job_config) else None
        if self.elastic_group is not None:
            elastic.attach(self)

    def train_step(self, data_iterator):
        if self.elastic_group is not None and elastic.quorum_due(self):
            self.elastic_group.start_step()
        return super().train_step(data_iterator)


def run(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if cpu_shim.needed():
        cpu_shim.apply()
    world = os.environ.get("WORLD_SIZE")
    check_config_or_exit(argv, int(world) if world else None)
    sys.argv = [sys.argv[0], *argv]
    forked = multiprocessing.parent_process() is not None  # started by flexdemo.titan.launch on CPU
    try:
        titan_main(FlexTrainer)
    except (ReplicaSettingsMismatch, ElasticJoinError) as e:  # before training, every rank alike: one line, exit 2
        _exit_config_error(str(e), process_group_up=True)
    except Exception:
        if forked:  # torch's multiprocessing start keeps it in an error file only: the rank's log shows it too
            traceback.print_exc()
        raise
    # Errors never get here: they raise out of titan_main. A rank forked by torchrun's
    # multiprocessing start (flexdemo.titan.launch on CPU) returns instead: torchrun waits for its
    # return value, and multiprocessing ends the process without interpreter teardown anyway.
    if cpu_shim.active() and not forked:
        cpu_shim.exit_without_teardown(0)
