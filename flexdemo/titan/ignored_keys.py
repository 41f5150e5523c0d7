"""Keys a config sets that its mode does not read: logged once as a warning by the optimizer
builder, so that nothing a user set is ignored silently."""

from __future__ import annotations

from dataclasses import fields

from torchtitan.config.job_config import Optimizer as _TitanOptimizer

from .config import FlexDemo

# [flexdemo] keys each mode reads (mode itself and the replica check: all of them).
_DEMO_KEYS = ("topk", "chunk", "decay", "value_encoding", "weight_decay", "overlap", "kernel_precision",
              "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips", "exchange",
              "sharded_topk", "overlap_lookahead", "index_coding")
_OUTER_KEYS = ("sync_interval", "outer_lr", "outer_momentum", "outer_nesterov", "outer_value_encoding",
               "outer_state_device", "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips")
_KEYS_USED = {
    "demo": _DEMO_KEYS,
    "diloco": _OUTER_KEYS,
    "demo_diloco": (*_OUTER_KEYS, "outer_topk", "outer_chunk", "outer_decay", "kernel_precision", "exchange",
                    "sharded_topk", "index_coding"),
    "off": (),
}
_KEYS_USED_BY_EVERY_MODE = ("mode", "replica_check_interval", "replica_check_action", "validation_same_batches")
# [optimizer] keys that DeMo does not read (it takes lr, and [lr_scheduler] scales it).
_OPTIMIZER_KEYS_UNUSED_BY_DEMO = ("name", "beta1", "beta2", "eps", "weight_decay", "implementation")


def ignored_keys(job_config) -> list[str]:
    """``section.key`` of every key set to a non-default value that the chosen mode does not read."""
    c: FlexDemo = job_config.flexdemo
    used = {*_KEYS_USED_BY_EVERY_MODE, *_KEYS_USED[c.mode]}
    out = [f"flexdemo.{f.name}" for f in fields(FlexDemo)
           if f.name not in used and getattr(c, f.name) != f.default]
    if c.mode == "demo":
        defaults = _TitanOptimizer()
        out += [f"optimizer.{k}" for k in _OPTIMIZER_KEYS_UNUSED_BY_DEMO
                if getattr(job_config.optimizer, k) != getattr(defaults, k)]
    return out
