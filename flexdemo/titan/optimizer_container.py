"""``FlexOptimizersContainer``: the torchtitan ``OptimizersContainer`` every flexdemo mode returns
(optimizer_builder.py builds it), so LR schedulers, DCP checkpoints (flattened optimizer state
dicts), step hooks and metrics work unchanged.

It adds, around the optimizers' step: the DiLoCo outer step (diloco, demo_diloco), finishing an
overlapped exchange at the run's last step, the periodic replica-identity check, and, from the
files named after them: replica-exchange accounting (exchange_accounting.py), skipped-update
reporting (skipped_steps.py) and flexdemo's checkpoint keys (checkpoint_keys.py).
"""

import contextlib
import time
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.tools.logging import logger

from flexdemo.compression.plan import describe_blocks
from flexdemo.optim.diloco import DiLoCo

from flexdemo.compression.exchange import is_elastic

from . import elastic
from . import replicas as rep
from .checkpoint_format import Resume
from .checkpoint_keys import BYTES_KEY, CheckpointKeys, replica_state_prefix
from .exchange_accounting import ExchangeAccounting
from .skipped_steps import SkipReporting


class FlexOptimizersContainer(CheckpointKeys, SkipReporting, ExchangeAccounting, OptimizersContainer):
    def __init__(
        self,
        model_parts: list[nn.Module],
        optimizer_cls: type,
        optimizer_kwargs: dict[str, Any],
        *,
        replicate_group,
        replica_check_interval: int,
        replica_check_action: str = "stop",
        modelled_bytes_per_step: int | None,
        per_replica_state: bool,
        format_key: str,
        resume: Resume | None = None,
        outer: DiLoCo | None = None,
        last_step: int | None = None,
        max_consecutive_skips: int = 0,
        elastic_replica_id: int = 0,
    ) -> None:
        super().__init__(model_parts, optimizer_cls, optimizer_kwargs)
        self.outer = outer
        if outer is not None:
            outer.set_inner_optimizers(self.optimizers)  # a discarded cycle resets their state
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps_total = 0  # per-step mode: skipped steps learned of so far
        self._skips_to_count: dict[int, set[int]] = {}  # skipped steps beyond the counted ones
        self._counted_through = 0  # every step up to this one is in the streak below
        self._skip_streak: list[tuple[int, set[int]]] = []  # (step, replicas) of the last skips in a row
        self.last_step = last_step
        self.format_key = format_key
        self.resume = resume  # until the checkpoint is loaded: how its keys map onto this run
        self._resume_renames: dict[str, str] = {}
        self.replicate_group = replicate_group
        self.replica_check_interval = replica_check_interval
        self.replica_check_action = replica_check_action
        # Mode "off": HSDP all-reduce bytes are modelled (FSDP does the comms, not us).
        self.modelled_bytes_per_step = modelled_bytes_per_step
        # An elastic replica's place among the planned replicas is its replica_id: per-replica
        # checkpoint keys stay its own whoever else is alive.
        self.replica = (elastic_replica_id if is_elastic(replicate_group)
                        else dist.get_rank(replicate_group) if replicate_group is not None else 0)
        self.replica_prefix = (
            replica_state_prefix(self.replica) if per_replica_state and replicate_group is not None else None
        )
        # Byte totals differ per rank (uneven shards): one copy per rank.
        self.bytes_key = f"{BYTES_KEY}.rank{dist.get_rank() if dist.is_initialized() else 0}"
        self.step_count = 0
        self.bytes_sent_total = 0
        self.bytes_received_total = 0
        self.last_bytes_sent = 0
        self.last_bytes_received = 0
        self.last_step_seconds = 0.0
        compressors = [getattr(o, "compressor", None) for o in self.optimizers]
        compressors.append(outer.compressor if outer is not None else None)
        self.uses_fused_kernels = any(c is not None and c.uses_fused_kernels for c in compressors)
        for c in compressors:  # every rank: its shard's blocks, which uneven shards make differ
            if c is not None:
                logger.info(f"flexdemo: {describe_blocks(c.buckets, c.encoding)}")
        names = {id(p): name for part in model_parts for name, p in part.named_parameters()}
        for opt in self.optimizers:
            if hasattr(opt, "param_names"):
                opt.param_names = names  # for messages that name a parameter
        self._fused_step_seconds: list[float] = []

    def step(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        if self.outer is not None:
            self.outer.before_inner_step()
        super().step(*args, **kwargs)
        if self.last_step is not None and self.step_count + 1 == self.last_step:
            for opt in self._overlapped():
                opt.finish_pending()  # the run's last update is not left in flight
        synced = self.outer.after_inner_step() if self.outer is not None else False
        self.last_step_seconds = time.perf_counter() - start
        self.step_count += 1
        self._account_exchange()
        self._report_skipped_step()
        if self.uses_fused_kernels and self.last_bytes_sent and len(self._fused_step_seconds) < 2:
            self._report_kernel_compilation()
        if synced and not self.outer.last_sync_committed:
            logger.warning(f"flexdemo: the outer step after step {self.step_count} was not committed (an elastic "
                           "replica failed during the exchange): nothing applied, the cycle goes on")
        elif synced:
            logger.info(
                f"flexdemo: outer step {self.outer.outer_steps} after step {self.step_count} "
                f"({self.outer.compression}, {self.last_bytes_sent} bytes sent, "
                f"{self.last_bytes_received} received over dp_replicate, "
                f"{1e3 * self.outer.last_sync_seconds:.1f} ms)"
            )
        # Validation makes the interval a multiple of sync_interval in the DiLoCo modes, so
        # the check always runs right after an outer step.
        if (
            self.replicate_group is not None
            and self.replica_check_interval
            and self.step_count % self.replica_check_interval == 0
        ):
            shared = [t for e in self.outer.entries for t in (e.global_copy, e.momentum) if t is not None] \
                if self.outer is not None else []
            if is_elastic(self.replicate_group):  # no torch.distributed world across replicas
                elastic.verify_identical(self.model_parts, self.replicate_group, self.step_count, self.outer)
                return
            with self.consensus():
                rep.verify_or_resync(self.model_parts, self.replicate_group, self.step_count,
                                     self.replica_check_action, shared)

    def _overlapped(self):
        return [o for o in self.optimizers if getattr(o, "overlap", False)]

    @contextlib.contextmanager
    def consensus(self):
        """The replicas' common parameters in the model for the duration (overlap_lookahead: the
        live ones hold each replica's own look-ahead; flexdemo.optim.lookahead)."""
        with contextlib.ExitStack() as stack:
            for opt in self._overlapped():
                stack.enter_context(opt.consensus())
            yield
