"""What flexdemo measures and reports of a run, beside torchtitan's own metrics.

* :class:`ExchangeMeter` (owned by the optimizers container): bytes sent / received over
  dp_replicate per step and in total (measured, or modelled for HSDP in mode off), the step's
  timings, and the one-time note on compiling the fused kernels.
* :class:`SkippedSteps` (owned by the replica sync of modes off and demo): a non-finite gradient
  in mode demo (a step skipped on every replica), logged and counted
  (``replica_exchange/skipped_steps``; in the DiLoCo modes that counts DiLoCo's discarded
  cycles); ``max_consecutive_skips`` in a row stop every rank, at the same step, with an error
  naming the replicas and parameters.
* :class:`FlexMetricsProcessor` (build_metrics_processor_fn): those numbers (bytes this step and
  in total, exchange time, updates skipped so far) go to TensorBoard/W&B through torchtitan's
  ``extra_metrics`` and to the console as one line printed right after torchtitan's own step line.
* :class:`SameBatchesValidator` (around the family's validator): held-out validation that scores
  the same batches every time.

torchtitan 0.2.2's validator keeps one dataloader and continues it where the previous
validation stopped, so each validation scores different text: the logged curve mixes the
model's progress with how hard each slice of the held-out split is (measured: a 1B run's
validation loss moved 3.09 -> 2.83 between steps 896 and 1024 and a dense DiLoCo run's
3.63 -> 2.64 within 200 steps). ``[flexdemo] validation_same_batches`` (default on) rewinds
that dataloader to its starting state before every validation, so the curve compares one
model against itself on fixed data and a resumed run scores what the uninterrupted one did.
The family's own validator does the work; this only rewinds its dataloader.

:class:`ConsensusValidator` (overlap_lookahead, under FlexTrainer) scores the replicas' common
parameters instead of this replica's look-ahead.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from flexdemo.data.dataset import is_embedded_dataset

from .config import replica_local_loss
from .heldout import build_heldout_dataloader
from .meters import ExchangeMeter, SkippedSteps, format_exchange_line, modelled_hsdp_allreduce_bytes  # noqa: F401 (re-exported)
from .validators import ConsensusValidator, SameBatchesValidator  # noqa: F401 (re-exported)


class FlexMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag=None):
        super().__init__(job_config, parallel_dims, tag)
        # FlexTrainer normalises each replica's loss by the replica's own tokens, so the sum
        # torchtitan logs as the average is replicas x the global mean loss.
        self._loss_scale = 1.0 / parallel_dims.dp_replicate if replica_local_loss(job_config) else 1.0

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        stats_fn = getattr(self.optimizers, "exchange_stats", None)
        stats = stats_fn() if stats_fn is not None else {}
        super().log(
            step, global_avg_loss * self._loss_scale, global_max_loss, grad_norm,
            extra_metrics={**(extra_metrics or {}), **stats},
        )
        if stats:
            logger.info(format_exchange_line(step, stats))


def build_flexdemo_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return FlexMetricsProcessor(job_config, parallel_dims, tag)


def wrap_validator_builder(build_validator: Callable[..., Any]) -> Callable[..., Any]:
    """The family's ``build_validator_fn``: for flexdemo's held-out splits its loader is the fixed
    windows of flexdemo.titan.heldout; its validator is rewound when the key asks for it."""
    positional = [p.name for p in inspect.signature(build_validator).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def build(*args, **kwargs):
        validator = build_validator(*args, **kwargs)
        given = {**dict(zip(positional, args)), **kwargs}  # torchtitan passes them by keyword
        job_config = given.get("job_config")
        if job_config is not None and is_embedded_dataset(job_config.validation.dataset):
            validator.validation_dataloader = build_heldout_dataloader(
                job_config, given["dp_world_size"], given["dp_rank"], given["tokenizer"])
        section = getattr(job_config, "flexdemo", None)
        if section is not None and section.validation_same_batches:
            return SameBatchesValidator(validator)
        return validator

    return build
