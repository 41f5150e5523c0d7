"""What a flexdemo checkpoint holds, and how another run resumes it.

The optimizers container's part of a checkpoint (:class:`OptimizerCheckpoint`, which the container
owns) is torchtitan's flattened optimizer state dict with flexdemo's keys added and per-replica
keys renamed; the rest (model, lr schedulers, dataloader, train state) is torchtitan's own.

Every optimizer state dict carries one tiny tensor whose key names the settings that give the
state its meaning and the topology it was written on:
``flexdemo.format[mode=demo,topk=32,...].replicas=2.shards=2``. Before training, the optimizer
builder reads the key names of the checkpoint torchtitan is about to load (DCP metadata only,
no tensors) and

* refuses a checkpoint of other settings (mode, top-k, chunk, encodings, overlap), or one written
  by another optimizer, with one clear message naming how to switch instead (start from its
  model only);
* with overlap, refuses an exchange in flight written in another payload format (its bytes are
  that format's; the tag names ``payload_format`` when overlap is on, from format 6: a tag
  without it is format 5 or earlier). Without overlap the state holds no payload bytes (DeMo's
  momentum and DiLoCo's state do not depend on how many coefficients a block keeps), so a
  checkpoint of an earlier format loads and the next exchange is in this code's format;
* maps the per-replica state (DeMo momentum, DiLoCo error feedback and local parameters, the
  inner optimizer's state) when the number of replicas changed: replica ``r`` of the new run
  takes saved replica ``r mod R_saved``'s own state (2 -> 4: replicas 2 and 3 start from copies
  of 0 and 1; 4 -> 2: the state of replicas 2 and 3 is dropped, as if those nodes had left);
* lets DCP reshard everything kept as DTensors when the number of shards changed;
* where the data-parallel world size (replicas x shards, what torchtitan's dataloader is built
  for) changed: flexdemo's corpora reshard their position (flexdemo.data.resharding), any other
  dataset is refused here, before any rank starts (torchtitan's ParallelAwareDataloader cannot
  reshard: it stops with an assertion when the world shrinks, a missing key when it grows).

Per-rank byte counters restart from zero when the world size changed (the step count goes on);
an exchange in flight (overlap) resumes on the same topology only.
"""

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger


FORMAT_PREFIX = "flexdemo.format["
# Extra keys in the (flattened) optimizer state dict: the step count (the same on every rank)
# and, per rank, [bytes_sent_total, bytes_received_total].
STEP_KEY = "flexdemo.step"
BYTES_KEY = "flexdemo.exchange_bytes"
# DeMo's momentum (and the inner AdamW state of the DiLoCo modes) differs between replicas
# (own gradients), but its DTensors live on the shard mesh only, so DCP would see equal
# "global" tensors on every replica and keep just one. Per-replica keys keep every replica's.
STATE_PREFIX = "state."
# The DiLoCo outer state: shared by all replicas, and per replica.
OUTER_PREFIX = "flexdemo.diloco."
# DeMo with overlap: the exchange in flight, per rank.
PENDING_PREFIX = "flexdemo.pending_exchange."
_FORMAT_RE = re.compile(r"^(?:optimizer\.)?flexdemo\.format\[(.*)\]\.replicas=(\d+)\.shards=(\d+)$")
_REPLICA_RE = re.compile(r"@replica(\d+)\.")


def format_key(tag: str, replicas: int, shards: int) -> str:
    return f"{FORMAT_PREFIX}{tag}].replicas={replicas}.shards={shards}"


def checkpoint_to_resume(job_config) -> str | None:
    """The checkpoint whose optimizer state torchtitan will load at start (as its Checkpointer
    finds it), or None (no checkpointing, nothing saved yet, or a model-only start)."""
    ck = job_config.checkpoint
    if not ck.enable:
        return None
    folder = os.path.join(job_config.job.dump_folder, ck.folder)
    if os.path.isdir(folder):
        steps = [int(m.group(1)) for name in os.listdir(folder)
                 if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))]
        step = ck.load_step if ck.load_step != -1 else max(steps, default=-1)
        return os.path.join(folder, f"step-{step}") if step > 0 else None
    if ck.initial_load_path and not ck.initial_load_model_only:
        return ck.initial_load_path
    return None


def saved_keys(path: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


@dataclass
class Resume:
    """How this run reads a saved optimizer state."""

    path: str
    format_key: str  # the saved format key (without the "optimizer." prefix)
    replicas: int  # saved topology
    shards: int
    keys: set[str]  # the saved optimizer keys, without the "optimizer." prefix
    elastic: bool = False  # an elastic replica's own checkpoint (one replica per job): keys under its replica_id

    def source_replica(self, replica: int) -> int:
        return replica if self.elastic else replica % self.replicas

    def map_key(self, key: str, replica: int) -> str:
        """A key of this replica's own state -> the saved key it is read from."""
        return _REPLICA_RE.sub(f"@replica{self.source_replica(replica)}.", key, count=1)


def check_resume_for_world(job_config, settings, world_size: int, error) -> Resume | None:
    """:func:`plan_resume` before any rank starts (the pre-flight), its layout read off the config's
    parallelism (0.2.2's names; 0.3.0's config seen through flexdemo.titan.v0_3.legacy) and the world size."""
    p = job_config.parallelism
    replicas = p.data_parallel_replicate_degree
    shards = world_size // (replicas * p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return plan_resume(job_config, settings, replicas, shards, error)


def plan_resume(job_config, settings, replicas: int, shards: int, error) -> Resume | None:
    """Check the checkpoint this run will resume against its ``settings`` (flexdemo.run_settings:
    the checkpoint tag, the mode's entry); raise ``error`` with one
    clear message where it cannot be resumed. None when nothing will be resumed."""
    path = checkpoint_to_resume(job_config)
    if path is None:
        return None
    every_key = saved_keys(path)
    _check_data_position(job_config, path, every_key, replicas, shards, error)
    keys = {k[len("optimizer."):] for k in every_key if k.startswith("optimizer.")}
    switch = (f"to continue from its weights with other settings or another optimizer, start a fresh "
              f"dump folder with --checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only")
    if not keys:
        raise error(f"checkpoint {path} holds the model only, no optimizer state: {switch}")
    formats = [m for m in map(_FORMAT_RE.match, keys) if m]
    if not formats:
        raise error(f"checkpoint {path} was not written by a flexdemo optimizer (no flexdemo.format key); {switch}")
    saved_tag, saved_replicas, saved_shards = formats[0].group(1), int(formats[0].group(2)), int(formats[0].group(3))
    tag = settings.checkpoint_tag
    saved_format, run_format = _payload_format(saved_tag), _payload_format(tag)
    if saved_tag != tag and _without_payload_format(saved_tag) == _without_payload_format(tag) and run_format:
        raise error(f"checkpoint {path} holds an exchange in flight (overlap) in payload format "
                    f"{saved_format or '5 or earlier'}, this code sends and reads format {run_format}: resume it "
                    f"with the flexdemo version that wrote it (finishing the exchange in flight), or {switch}")
    if saved_tag != tag:
        raise error(f"checkpoint {path} was written with [{saved_tag}], this run asks for [{tag}]; {switch}")
    if (saved_replicas, saved_shards) != (replicas, shards) and settings.mode.in_flight(settings.section):
        raise error(f"checkpoint {path} holds an exchange in flight (overlap) of {saved_replicas} replicas x "
                    f"{saved_shards} shards; resume it on that topology")
    return Resume(path, formats[0].group(0).removeprefix("optimizer."), saved_replicas, saved_shards, keys,
                  elastic=bool(job_config.fault_tolerance.enable) and saved_replicas == 1)


def _payload_format(tag: str) -> str | None:
    """The payload format a tag names (overlap's exchange in flight, from format 6), else None."""
    return next((item.split("=", 1)[1] for item in tag.split(",") if item.startswith("payload_format=")), None)


def _without_payload_format(tag: str) -> str:
    return ",".join(item for item in tag.split(",") if not item.startswith("payload_format="))


def _check_data_position(job_config, path: str, every_key: set[str], replicas: int, shards: int, error) -> None:
    """A checkpoint's data position loads where the data-parallel world size is the one it was
    written by, or the dataset is one of flexdemo's (which reshard it); raise ``error`` otherwise."""
    from flexdemo.data.dataset import is_embedded_dataset
    from flexdemo.data.resharding import saved_data_parallel_ranks

    if "dataloader" in (job_config.checkpoint.exclude_from_loading or []):
        return
    saved = saved_data_parallel_ranks(every_key)
    dp = replicas * shards // max(1, job_config.parallelism.context_parallel_degree)
    if saved and saved != dp and not is_embedded_dataset(job_config.training.dataset):
        raise error(
            f"checkpoint {path} holds the data position of {saved} data-parallel ranks, this run has {dp} "
            f"(replicas x shards): torchtitan's dataloader for dataset {job_config.training.dataset!r} cannot "
            f"reshard it. Resume on {saved} data-parallel ranks, or add --checkpoint.exclude_from_loading "
            "dataloader to restart the data from its beginning (samples are then read again)"
        )


def replica_state_prefix(replica: int) -> str:
    return f"state@replica{replica}."


def replica_outer_prefix(replica: int) -> str:
    return f"flexdemo.diloco@replica{replica}."


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@dataclass
class Loaded:
    """What :meth:`OptimizerCheckpoint.load` hands back to the container."""

    optimizers: dict[str, Any]  # torchtitan's flattened state dict of the optimizers
    step: int | None  # the step count saved, if any
    byte_totals: tuple[int, int] | None  # this rank's saved (sent, received), if any


class OptimizerCheckpoint:
    """The optimizers container's keys in a checkpoint: ``format_key`` names its settings and
    topology; with ``per_replica_state`` the optimizers' state goes under this replica's own keys;
    ``resume`` (until the checkpoint is loaded) maps the keys onto a saved one of another topology."""

    def __init__(self, format_key: str, resume: Resume | None, replica: int, per_replica_state: bool,
                 job_replicas: int) -> None:
        self.format_key = format_key
        self.resume = resume
        self.replica = replica
        self.replica_prefix = replica_state_prefix(replica) if per_replica_state else None
        self.job_replicas = job_replicas  # replicas in this job (an elastic replica's job holds one)
        # Byte totals differ per rank (uneven shards): one copy per rank.
        self.bytes_key = f"{BYTES_KEY}.rank{dist.get_rank() if dist.is_initialized() else 0}"
        self._resume_renames: dict[str, str] = {}

    def save(self, sd: dict[str, Any], *, step: int, byte_totals: tuple[int, int], sync, overlapped) -> dict[str, Any]:
        """torchtitan's flattened optimizer state ``sd`` as this checkpoint keeps it."""
        if self.replica_prefix:
            sd = {_swap_prefix(k, STATE_PREFIX, self.replica_prefix): v for k, v in sd.items()}
        sd[self.format_key] = torch.zeros(1, dtype=torch.int64)  # its name is what counts
        sd[STEP_KEY] = torch.tensor([step], dtype=torch.int64)
        sd[self.bytes_key] = torch.tensor(list(byte_totals), dtype=torch.int64)
        sd.update(sync.state_dict(OUTER_PREFIX, replica_outer_prefix(self.replica)))  # DiLoCo's outer state
        for i, opt in enumerate(overlapped):
            # The exchange in flight: every replica's bytes, as this rank gathered them.
            for name, value in opt.pending_state().items():
                sd[f"{PENDING_PREFIX}{i}.rank{dist.get_rank()}.{name}"] = value
        return sd if self.resume is None else self._as_saved(sd)

    def _as_saved(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The keys to load: this replica's own state from saved replica ``r mod R_saved``, the
        saved format key; byte counters only where this rank's exist (same world size)."""
        resume, out, self._resume_renames = self.resume, {}, {}
        same_world = resume.replicas * resume.shards == world_size()
        for key, value in sd.items():
            saved = resume.format_key if key == self.format_key else resume.map_key(key, self.replica)
            if key == self.bytes_key and not (same_world and saved in resume.keys):
                continue  # the counters of another topology: this run's start from zero
            out[saved] = value
            self._resume_renames[saved] = key
        return out

    def load(self, state_dict: dict[str, Any], *, sync, overlapped) -> Loaded:
        """Load flexdemo's own keys of ``state_dict`` (the exchange in flight, the DiLoCo outer state);
        the rest back under torchtitan's keys, for the container's optimizers."""
        if self.resume is not None:
            state_dict = {self._resume_renames.get(k, k): v for k, v in state_dict.items()}
            self._log_resume()
            self.resume = None
        state_dict = dict(state_dict)
        state_dict.pop(self.format_key, None)
        step = state_dict.pop(STEP_KEY, None)
        counted = state_dict.pop(self.bytes_key, None)
        for i, opt in enumerate(overlapped):
            prefix = f"{PENDING_PREFIX}{i}.rank{dist.get_rank()}."
            opt.load_pending_state({k[len(prefix):]: state_dict.pop(k) for k in list(state_dict)
                                    if k.startswith(prefix)})
        prefixes = (OUTER_PREFIX, replica_outer_prefix(self.replica))
        sync.load_state_dict({k: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefixes)}, *prefixes)
        if self.replica_prefix:
            state_dict = {_swap_prefix(k, self.replica_prefix, STATE_PREFIX): v for k, v in state_dict.items()}
        return Loaded(state_dict, None if step is None else int(step.item()),
                      None if counted is None else tuple(int(x) for x in counted.tolist()))

    def _log_resume(self) -> None:
        r = self.resume
        replicas = self.job_replicas
        shards = world_size() // replicas
        if (r.replicas, r.shards) == (replicas, shards):
            return
        logger.warning(
            f"flexdemo: resuming {r.path} (written by {r.replicas} replicas x {r.shards} shards) on {replicas} x "
            f"{shards}: replica {self.replica} takes saved replica {r.source_replica(self.replica)}'s own state, "
            "sharded tensors are resharded"
            + ("" if r.replicas * r.shards == world_size() else ", byte counters restart from zero")
        )


def _swap_prefix(key: str, old: str, new: str) -> str:
    return new + key[len(old):] if key.startswith(old) else key
