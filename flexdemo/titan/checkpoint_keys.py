"""The optimizer container's part of a checkpoint: torchtitan's flattened optimizer state dict
with flexdemo's keys added and per-replica keys renamed, and the mapping of those keys onto a
saved checkpoint of another topology (flexdemo.titan.checkpoint_format plans it).

Mixed into FlexOptimizersContainer (optimizer_container.py), whose attributes it reads:
``format_key``, ``resume``, ``replica``, ``replica_prefix``, ``replicate_group``, ``outer``,
``bytes_key``, ``step_count``, the byte totals and ``_overlapped()``.
"""

from typing import Any

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from flexdemo.compression.exchange import is_elastic

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


def replica_state_prefix(replica: int) -> str:
    return f"state@replica{replica}."


def replica_outer_prefix(replica: int) -> str:
    return f"flexdemo.diloco@replica{replica}."


class CheckpointKeys:
    """state_dict / load_state_dict of the container (before OptimizersContainer in its bases)."""

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        if self.replica_prefix:
            sd = {_swap_prefix(k, STATE_PREFIX, self.replica_prefix): v for k, v in sd.items()}
        sd[self.format_key] = torch.zeros(1, dtype=torch.int64)  # its name is what counts
        sd[STEP_KEY] = torch.tensor([self.step_count], dtype=torch.int64)
        sd[self.bytes_key] = torch.tensor([self.bytes_sent_total, self.bytes_received_total], dtype=torch.int64)
        if self.outer is not None:
            sd.update(self.outer.state_dict(OUTER_PREFIX, self._outer_replica_prefix()))
        for i, opt in enumerate(self._overlapped()):
            # The exchange in flight: every replica's bytes, as this rank gathered them.
            for name, value in opt.pending_state().items():
                sd[f"{PENDING_PREFIX}{i}.rank{dist.get_rank()}.{name}"] = value
        return sd if self.resume is None else self._as_saved(sd)

    def _as_saved(self, sd: dict[str, Any]) -> dict[str, Any]:
        """The keys to load: this replica's own state from saved replica ``r mod R_saved``, the
        saved format key; byte counters only where this rank's exist (same world size)."""
        resume, out, self._resume_renames = self.resume, {}, {}
        same_world = resume.replicas * resume.shards == self.world_size()
        for key, value in sd.items():
            saved = resume.format_key if key == self.format_key else resume.map_key(key, self.replica)
            if key == self.bytes_key and not (same_world and saved in resume.keys):
                continue  # the counters of another topology: this run's start from zero
            out[saved] = value
            self._resume_renames[saved] = key
        return out

    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def _outer_replica_prefix(self) -> str:
        return replica_outer_prefix(self.replica)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.resume is not None:
            state_dict = {self._resume_renames.get(k, k): v for k, v in state_dict.items()}
            self._log_resume()
            self.resume = None
        state_dict = dict(state_dict)
        state_dict.pop(self.format_key, None)
        step = state_dict.pop(STEP_KEY, None)
        counted = state_dict.pop(self.bytes_key, None)
        for i, opt in enumerate(self._overlapped()):
            prefix = f"{PENDING_PREFIX}{i}.rank{dist.get_rank()}."
            opt.load_pending_state({k[len(prefix):]: state_dict.pop(k) for k in list(state_dict)
                                    if k.startswith(prefix)})
        if self.outer is not None:
            prefixes = (OUTER_PREFIX, self._outer_replica_prefix())
            outer_sd = {k: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefixes)}
            # Also restores each replica's own local parameters (the model's keys hold one
            # replica's shards only): must run after DCP has loaded the model's tensors.
            self.outer.load_state_dict(outer_sd, *prefixes)
        if self.replica_prefix:
            state_dict = {_swap_prefix(k, self.replica_prefix, STATE_PREFIX): v for k, v in state_dict.items()}
        super().load_state_dict(state_dict)
        if step is not None:
            self.step_count = self._counted_through = int(step.item())
        if counted is not None:
            self.bytes_sent_total, self.bytes_received_total = (int(x) for x in counted.tolist())

    def _log_resume(self) -> None:
        r = self.resume
        # an elastic replica's checkpoint is its own job's: one replica
        replicas = (1 if self.replicate_group is None or is_elastic(self.replicate_group)
                    else dist.get_world_size(self.replicate_group))
        shards = self.world_size() // replicas
        if (r.replicas, r.shards) == (replicas, shards):
            return
        logger.warning(
            f"flexdemo: resuming {r.path} (written by {r.replicas} replicas x {r.shards} shards) on {replicas} x "
            f"{shards}: replica {self.replica} takes saved replica {r.source_replica(self.replica)}'s own state, "
            "sharded tensors are resharded"
            + ("" if r.replicas * r.shards == self.world_size() else ", byte counters restart from zero")
        )


def _swap_prefix(key: str, old: str, new: str) -> str:
    return new + key[len(old):] if key.startswith(old) else key
