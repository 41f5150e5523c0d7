"""Elastic replicas in torchtitan: ``[fault_tolerance] enable = true``, one torchrun job per replica.

Each replica (a node) runs its own torchrun with ``[parallelism] data_parallel_replicate_degree
= 1`` (FSDP over its own GPUs) and ``[fault_tolerance] replica_id`` / ``group_size`` (how many
replicas the run is planned for: the data are split that many ways) / ``min_replica_size``.
Between replicas there is no torch.distributed world: flexdemo's exchange runs over torchft's
process group (:class:`flexdemo.elastic.ElasticGroup`), reformed by the Lighthouse
(``$TORCHFT_LIGHTHOUSE``, ``scripts/lighthouse.sh``) before every step.

In the DiLoCo modes the quorum is formed only at a cycle's start (the outer step's members
are those that start the cycle together; nothing crosses between replicas in between), so a
replica rejoins where the others' parameters are the global copy they share.

What a rejoining replica takes from a live peer (torchft's checkpoint transport, before its
first forward pass): the parameters, the lr schedule and the lrs it set, the step and token
counts, the optimizer container's counters, and in the DiLoCo modes the global copy and outer
momentum. Not DeMo's momentum, nor DiLoCo's error feedback or inner optimizer state: they are
each replica's own (a copy of a peer's momentum would make the two send the same coefficients
from then on); the rejoined replica's are what its own checkpoint held, or zero as at step 1.
Its data: its own shard from where its checkpoint left it, or from the start (torchft's
default; the dataloader is not healed), so some of its documents are seen twice. Before
loading anything it compares the peer's settings and install with its own
(flexdemo.run_settings) and is refused on a difference.

The checks of ``[fault_tolerance]`` (:func:`check_elastic`) run with the rest of the config's
(flexdemo.titan.config), before any process group exists.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torchtitan.components.checkpoint import LR_SCHEDULER, MODEL
from torchtitan.tools.logging import logger

from flexdemo.compression.agreement import first_difference
from flexdemo.elastic.group import LIGHTHOUSE_ENV, ElasticGroup, ElasticJoinError
from flexdemo.modes import MODES, mode_of



def enabled(job_config) -> bool:
    return bool(job_config.fault_tolerance.enable)


def elastic_group(job_config) -> ElasticGroup:
    """This replica's elastic group, made once by the optimizer builder: the optimizers' container
    holds it (``replicate_group``), and the trainer reads it there."""
    ft = job_config.fault_tolerance
    group = ElasticGroup.create(
        replica_id=ft.replica_id, min_replicas=ft.min_replica_size, backend=ft.process_group,
        timeout_s=ft.process_group_timeout_ms / 1000, state_dict=None, load_state_dict=None,
    )
    logger.info(f"flexdemo: elastic replica {ft.replica_id} of {ft.group_size} planned "
                f"(torchft, at least {ft.min_replica_size} per step, {ft.process_group})")
    return group


def data_shard(job_config, dp_world_size: int, dp_rank: int) -> tuple[int, int]:
    """This rank's data shard among every replica's ranks (torchtitan's FTManager.get_dp_info)."""
    if not enabled(job_config):
        return dp_world_size, dp_rank
    ft = job_config.fault_tolerance
    return shard_among_replicas(dp_world_size, dp_rank, ft.group_size, ft.replica_id)


def shard_among_replicas(dp_world_size: int, dp_rank: int, group_size: int, replica_id: int) -> tuple[int, int]:
    return dp_world_size * group_size, dp_world_size * replica_id + dp_rank


def quorum_due(trainer) -> bool:
    """Whether this step starts with a quorum: every step, but in the DiLoCo modes only at a
    cycle's start."""
    return trainer.optimizers.sync.at_cycle_start


def attach(trainer, states=None) -> None:
    """Let a rejoining replica heal from this one's state, and this one from a live peer's. Either
    torchtitan's trainer (0.2.2, 0.3.0): the optimizers container (flexdemo.titan.container), the
    trainer's own ``state_dict`` (step, tokens seen) and ``states``, the checkpointer's (default)
    or (0.3.0 with checkpoints off: it keeps none) the same MODEL and LR_SCHEDULER wrappers."""
    container, states = trainer.optimizers, trainer.checkpointer.states if states is None else states
    group, sync = container.replicate_group, container.sync
    # the run's settings and install, and the very lists the start-up agreement compared
    settings = container.run_settings.items() + container.agreement_settings()
    replica_id = container.replica  # an elastic replica's place is its fault_tolerance.replica_id

    def state_dict():
        # torchft serves these while this replica trains on: it copies device tensors to the host
        # before the quorum returns, host tensors not, so those are copied here. The lrs as well
        # as the schedule: a scheduler's state sets its optimizer's lr only at its next step.
        model = {k: v.detach().clone() if torch.is_tensor(v) and v.device.type == "cpu" else v
                 for k, v in states[MODEL].state_dict().items()}
        return {"settings": settings, "model": model, "lr_scheduler": states[LR_SCHEDULER].state_dict(),
                "lrs": [[g["lr"] for g in opt.param_groups] for opt in container.optimizers],
                "train_state": trainer.state_dict(), "optimizer_steps": container.step_count,
                "outer": sync.heal_state()}

    def load_state_dict(sd):
        refuse_if_different(settings, sd["settings"], replica_id)  # before anything is loaded
        states[MODEL].load_state_dict(sd["model"])
        states[LR_SCHEDULER].load_state_dict(sd["lr_scheduler"])
        for opt, lrs in zip(container.optimizers, sd["lrs"], strict=True):
            for g, lr in zip(opt.param_groups, lrs, strict=True):
                g["lr"] = lr
        trainer.load_state_dict(sd["train_state"])
        container.step_count = sd["optimizer_steps"]
        sync.load_heal_state(sd["outer"])
        logger.info(f"flexdemo: elastic replica healed from a live peer at step {trainer.step}")

    group.manager.register_state_dict_fn("flexdemo", load_state_dict, state_dict)


# -- the checks of [fault_tolerance] ---------------------------------------------------------

def check_elastic(job_config, fail) -> None:
    """The checks of ``[fault_tolerance]`` for flexdemo's elastic replicas; ``fail(message)`` raises
    the config error."""
    c, ft, p = job_config.flexdemo, job_config.fault_tolerance, job_config.parallelism
    if not mode_of(c).elastic:
        fail(f"fault_tolerance.enable: mode={c.mode!r} cannot run elastic replicas (its replicas are one "
             f"FSDP job); modes that can: {', '.join(m.name for m in MODES.values() if m.elastic)}")
    if ft.semi_sync_method is not None:
        fail(f"fault_tolerance.semi_sync_method={ft.semi_sync_method!r} is torchtitan's own DiLoCo; flexdemo's "
             "modes bring their own exchange: leave it unset")
    if p.data_parallel_replicate_degree != 1:
        fail(f"fault_tolerance.enable: each replica is its own torchrun job, so "
             f"parallelism.data_parallel_replicate_degree must be 1 (got {p.data_parallel_replicate_degree}); "
             "the replicas are counted by fault_tolerance.group_size")
    if ft.group_size < 1 or not 0 <= ft.replica_id < ft.group_size:
        fail(f"fault_tolerance.group_size={ft.group_size}, replica_id={ft.replica_id}: need group_size >= 1 "
             "(the replicas the run is planned for) and 0 <= replica_id < group_size")
    if not 1 <= ft.min_replica_size <= ft.group_size:
        fail(f"fault_tolerance.min_replica_size={ft.min_replica_size}: need 1 <= it <= group_size={ft.group_size}")
    if ft.process_group not in ("gloo", "nccl"):
        fail(f"fault_tolerance.process_group={ft.process_group!r}; expected 'gloo' or 'nccl'")
    if c.replica_check_action == "resync":
        fail("fault_tolerance.enable with flexdemo.replica_check_action = \"resync\": elastic replicas heal from "
             "a live peer through torchft, not by a broadcast; use \"stop\" (a replica that differs stops and "
             "rejoins healed)")
    if c.overlap:
        fail("fault_tolerance.enable with flexdemo.overlap: an exchange left in flight cannot cross a change "
             "of the replicas taking part; turn overlap off")
    if importlib.util.find_spec("torchft") is None:
        fail("fault_tolerance.enable needs torchft: pip install -e \".[ft]\"")
    if not os.environ.get("TORCHFT_LIGHTHOUSE"):
        fail(f"fault_tolerance.enable needs ${LIGHTHOUSE_ENV}=http://HOST:PORT, the Lighthouse of "
             "scripts/lighthouse.sh")


# -- what a joining replica must share with the quorum -------------------------------------
# Replicas that train with different settings would pair different collectives or decode the
# same bytes differently; over a fixed group flexdemo's start-up agreement catches that
# (flexdemo.run_settings, flexdemo.compression.agreement), but an elastic replica joins a quorum
# that is already training. So the peer's settings travel with its state (attach: every joining
# replica heals from a live peer, at step 0 too, torchft's init_sync), and the joiner compares
# them with its own before it loads anything: a difference refuses it, naming the first setting
# that differs.


def refuse_if_different(mine: list[tuple[str, str]], quorum: list[tuple[str, str]], replica_id: int) -> None:
    """Raise ElasticJoinError (one line) naming the first setting where this replica differs."""
    diff = first_difference([tuple(x) for x in quorum], mine)
    if diff is not None:
        setting, theirs, ours = diff
        raise ElasticJoinError(
            f"elastic replica {replica_id} refused at join: its {setting} is {ours}, the quorum's is {theirs}; "
            "every replica must run the same settings and install"
        )
