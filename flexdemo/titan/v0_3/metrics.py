"""flexdemo's metrics on torchtitan 0.3.0 (0.2.2: flexdemo.titan.metrics.FlexMetricsProcessor):
the exchange's numbers (flexdemo.titan.meters) to TensorBoard/W&B through torchtitan's
``extra_metrics`` and one console line per logged step; the logged loss stays the global mean
although FlexTrainer normalises each replica's loss by its own tokens (torchtitan then sums
replicas x the mean: rescaled here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from ..meters import format_exchange_line


class FlexMetricsProcessor(MetricsProcessor):
    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    loss_scale: float = 1.0  # FlexTrainer sets 1 / replicas when the loss is replica-local

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        stats_fn = getattr(self.optimizers, "exchange_stats", None)
        stats = stats_fn() if stats_fn is not None else {}
        super().log(step, global_avg_loss * self.loss_scale, global_max_loss, grad_norm,
                    extra_metrics={**(extra_metrics or {}), **stats})
        if stats:
            logger.info(format_exchange_line(step, stats))
