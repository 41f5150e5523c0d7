"""What a flexdemo checkpoint holds, and how another run resumes it.

Every optimizer state dict carries one tiny tensor whose key names the settings that give the
state its meaning and the topology it was written on:
``flexdemo.format[mode=demo,topk=32,...].replicas=2.shards=2``. Before training, the optimizer
builder reads the key names of the checkpoint torchtitan is about to load (DCP metadata only,
no tensors) and

* refuses a checkpoint of other settings (mode, top-k, chunk, encodings, overlap), or one written
  by another optimizer, with one clear message naming how to switch instead (start from its
  model only);
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

FORMAT_PREFIX = "flexdemo.format["
_FORMAT_RE = re.compile(r"^(?:optimizer\.)?flexdemo\.format\[(.*)\]\.replicas=(\d+)\.shards=(\d+)$")
_REPLICA_RE = re.compile(r"@replica(\d+)\.")


def format_tag(cfg) -> str:
    """The settings without which a saved state cannot be read correctly."""
    items = {"mode": cfg.mode}
    if cfg.mode == "demo":
        items.update(topk=cfg.topk, chunk=cfg.chunk, value_encoding=cfg.value_encoding, overlap=cfg.overlap)
        if cfg.overlap_lookahead:  # its state holds the common parameters (named only when on: older tags stand)
            items.update(lookahead=True)
        if cfg.index_coding != "fixed":  # the bytes of an exchange in flight (overlap)
            items.update(index_coding=cfg.index_coding)
    elif cfg.mode in ("diloco", "demo_diloco"):
        items.update(outer_momentum=cfg.outer_momentum > 0, outer_value_encoding=cfg.outer_value_encoding)
        if cfg.mode == "demo_diloco":
            items.update(outer_topk=cfg.outer_topk, outer_chunk=cfg.outer_chunk)
    return ",".join(f"{k}={v}" for k, v in items.items())


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


def plan_resume(job_config, cfg, replicas: int, shards: int, error) -> Resume | None:
    """Check the checkpoint this run will resume against its settings; raise ``error`` with one
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
    tag = format_tag(cfg)
    if saved_tag != tag:
        raise error(f"checkpoint {path} was written with [{saved_tag}], this run asks for [{tag}]; {switch}")
    if (saved_replicas, saved_shards) != (replicas, shards) and cfg.mode == "demo" and cfg.overlap:
        raise error(f"checkpoint {path} holds an exchange in flight (overlap) of {saved_replicas} replicas x "
                    f"{saved_shards} shards; resume it on that topology")
    return Resume(path, formats[0].group(0).removeprefix("optimizer."), saved_replicas, saved_shards, keys,
                  elastic=bool(job_config.fault_tolerance.enable) and saved_replicas == 1)


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
