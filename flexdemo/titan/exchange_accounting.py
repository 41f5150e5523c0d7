"""Replica-exchange accounting of the optimizer container: bytes sent / received over
dp_replicate per step and in total (measured, or modelled for HSDP in mode off), the step's
timings, the numbers the metrics processor logs, and the one-time note on compiling the fused
kernels.

Mixed into FlexOptimizersContainer (optimizer_container.py), whose attributes it reads:
``optimizers``, ``outer``, ``modelled_bytes_per_step``, ``last_step_seconds``,
``skipped_steps_total``, ``_fused_step_seconds``.
"""

import torch
from torch.distributed.tensor import DTensor
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger


class ExchangeAccounting:
    """Byte counters, timings and metrics numbers of the container."""

    def _report_kernel_compilation(self) -> None:
        """The first exchange step compiles the fused Triton kernels (seconds); say so, and,
        at the next one, how long the compilation took. Triton keeps them on disk for later runs."""
        from flexdemo.kernels import triton_cache_dir

        self._fused_step_seconds.append(self.last_step_seconds)
        if len(self._fused_step_seconds) == 1:
            logger.info(
                f"flexdemo: the first exchange step took {self.last_step_seconds:.1f} s: it compiles the fused "
                f"Triton kernels (cached in {triton_cache_dir()} for later runs on this machine)"
            )
        else:
            first, second = self._fused_step_seconds
            logger.info(
                f"flexdemo: compiling the fused Triton kernels took about {max(first - second, 0.0):.1f} s "
                f"(first exchange step {first:.1f} s, the next {second:.2f} s)"
            )

    def _account_exchange(self) -> None:
        if self.modelled_bytes_per_step is not None:
            sent = received = self.modelled_bytes_per_step
        elif self.outer is not None:
            sent, received = self.outer.last_traffic.sent, self.outer.last_traffic.received
        else:
            sent = sum(int(getattr(o, "last_step_bytes_sent", 0)) for o in self.optimizers)
            received = sum(int(getattr(o, "last_step_bytes_received", 0)) for o in self.optimizers)
        self.last_bytes_sent, self.last_bytes_received = sent, received
        self.bytes_sent_total += sent
        self.bytes_received_total += received

    @property
    def last_exchange_seconds(self) -> float | None:
        """The last step's exchange time (None: not measured). On CUDA reading it waits for the
        exchange's end event, so it is read when asked (the metrics, at log steps), not after
        every step: that was a host sync per step, the GPU idle until the CPU caught up."""
        if self.modelled_bytes_per_step is not None:
            return None
        if self.outer is not None:
            return self.outer.last_exchange_seconds
        return sum(float(getattr(o, "last_step_exchange_seconds", 0.0)) for o in self.optimizers)

    def exchange_stats(self) -> dict[str, float]:
        """Replica-dimension traffic of this rank, for the metrics processor. Bytes that were
        not measured (mode off: HSDP's all-reduce, modelled from the gradient size) carry
        their own names, ``*_modelled``, never those of measured bytes."""
        tag = "_modelled" if self.modelled_bytes_per_step is not None else ""
        stats = {
            f"replica_exchange/bytes_sent{tag}": self.last_bytes_sent,
            f"replica_exchange/bytes_received{tag}": self.last_bytes_received,
            f"replica_exchange/bytes_sent_total{tag}": self.bytes_sent_total,
            f"replica_exchange/bytes_received_total{tag}": self.bytes_received_total,
            "replica_exchange/optimizer_step(s)": self.last_step_seconds,
        }
        if not tag:  # flexdemo's own exchange: updates it skipped (DiLoCo modes: outer steps)
            skipped = self.outer.skipped_syncs if self.outer is not None else self.skipped_steps_total
            stats["replica_exchange/skipped_steps"] = skipped
        seconds = self.last_exchange_seconds
        if seconds is not None:
            stats["replica_exchange/exchange(s)"] = seconds
        outer_seconds = self.outer.last_sync_seconds if self.outer is not None else None
        if outer_seconds is not None:
            stats["replica_exchange/outer_step(s)"] = outer_seconds  # the last one
        return stats

    # -- checkpointing: torchtitan's flattened optimizer state + flexdemo's -------------

def modelled_hsdp_allreduce_bytes(model_parts, parallel_dims: ParallelDims, reduce_dtype) -> int:
    """Bytes one rank sends (= receives) per step in HSDP's ring all-reduce over replicas."""
    r = parallel_dims.dp_replicate
    if r == 1:
        return 0
    shards = parallel_dims.dp_shard * parallel_dims.cp
    elem = torch.empty((), dtype=reduce_dtype).element_size()
    numel = 0
    for part in model_parts:
        for p in part.parameters():
            if isinstance(p, DTensor):  # FSDP all-reduces the dim-0 padded shard
                rows = -(-p.shape[0] // shards) if p.dim() else 1
                numel += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
            else:
                numel += p.numel()
    return 2 * (r - 1) * numel * elem // r
