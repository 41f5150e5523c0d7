"""build_metrics_processor_fn: torchtitan's MetricsProcessor + replica-exchange metrics.

The extra numbers (bytes sent/received over dp_replicate this step and in total,
exchange time, updates skipped for non-finite values so far) go to TensorBoard/W&B through
torchtitan's ``extra_metrics`` and to the console as one line printed right after
torchtitan's own step line.
"""

from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from .config import replica_local_loss


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


def format_exchange_line(step: int, s: dict[str, Any]) -> str:
    """One parseable console line; byte counts are exact integers. Modelled (not measured)
    byte counts are named ``*_bytes_modelled``."""
    modelled = "replica_exchange/bytes_sent_modelled" in s
    tag = "_modelled" if modelled else ""
    line = (
        f"flexdemo step: {step:2}  "
        f"sent_bytes{tag}: {s[f'replica_exchange/bytes_sent{tag}']}  "
        f"received_bytes{tag}: {s[f'replica_exchange/bytes_received{tag}']}  "
        f"sent_bytes_total{tag}: {s[f'replica_exchange/bytes_sent_total{tag}']}  "
        f"received_bytes_total{tag}: {s[f'replica_exchange/bytes_received_total{tag}']}  "
        f"optimizer_step_ms: {1e3 * s['replica_exchange/optimizer_step(s)']:.1f}"
    )
    if modelled:
        return line + "  (modelled ring all-reduce of HSDP/DDP, mode=off)"
    line += f"  exchange_ms: {1e3 * s['replica_exchange/exchange(s)']:.1f}"
    if "replica_exchange/skipped_steps" in s:  # updates skipped for non-finite values, cumulative
        line += f"  skipped_steps: {s['replica_exchange/skipped_steps']}"
    return line


def build_flexdemo_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return FlexMetricsProcessor(job_config, parallel_dims, tag)
