"""The modes, each declared once: what a mode reads, checks, builds, records and keeps.

Every reader of a mode asks its :class:`Mode` here, never its name: the torchtitan adapter (config
checks, which keys a config set in vain, the optimizer builder, the checkpoint tag, the memory
line, elastic replicas) and the planner. This module imports no torchtitan, so a second adapter
(another torchtitan version) and the planner use the same entries. A new mode is one entry below
and its builder (docs/design.md, "Modes").

* ``off``: torchtitan's Adam/AdamW; the replicas are one HSDP job (FSDP's all-reduce spans them).
* ``demo``: DeMo on every parameter, its compressed exchange across the replicas every step.
* ``diloco`` / ``demo_diloco``: Adam/AdamW inside each replica, an outer step every
  ``sync_interval`` steps, its exchange dense / DCT (or raw) top-k compressed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from flexdemo.optim.diloco_args import DENSE_ENCODINGS, TOPK_ENCODINGS

# torchtitan's logger is the root logger: lines look like its own.
logger = logging.getLogger()

PARAM_BYTES = 4  # an fp32 parameter-shaped state tensor, per element
MOMENTUM_BYTES = {"float32": 4, "bfloat16": 2}

# [flexdemo] keys every mode reads.
EVERY_MODE_KEYS = ("mode", "replica_check_interval", "replica_check_action", "validation_same_batches",
                   "memory_check")
_DEMO_KEYS = ("topk", "chunk", "decay", "value_encoding", "weight_decay", "overlap", "kernel_precision",
              "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips", "exchange",
              "sharded_topk", "overlap_lookahead", "index_coding", "momentum_dtype", "momentum_device")
_OUTER_KEYS = ("sync_interval", "outer_lr", "outer_momentum", "outer_nesterov", "outer_value_encoding",
               "outer_state_device", "init_sync", "exchange_timeout_seconds", "nonfinite", "max_consecutive_skips")
_TOPK_OUTER_KEYS = ("outer_topk", "outer_chunk", "outer_decay", "outer_transform", "kernel_precision",
                    "exchange", "sharded_topk", "index_coding")
# [optimizer] keys DeMo does not read (it takes lr, and [lr_scheduler] scales it).
_OPTIMIZER_KEYS_DEMO_IGNORES = ("name", "beta1", "beta2", "eps", "weight_decay", "implementation")


@dataclass(frozen=True)
class StateBytes:
    device: int  # optimizer-state bytes per parameter element on the GPU
    host: int  # ... in pinned host memory (momentum_device / outer_state_device = "cpu")


@dataclass
class Built:
    """What a mode's builder hands the adapter's optimizers container: the optimizer class and
    arguments it instantiates per model part, and the mode's own parts."""
    optimizer_cls: type
    optimizer_kwargs: dict[str, Any]
    per_replica_state: bool  # each replica's optimizer state is its own (checkpointed per replica)
    # inner optimizers -> the DiLoCo outer step (flexdemo.optim.DiLoCo) built around them; None: no outer step
    outer: Callable[[list], Any] | None = None
    container_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. last_step for DeMo's overlap


# A builder: (model_parts, cfg, replica group, inner (the [optimizer]'s class and kwargs, or None),
# keywords lr, steps (training steps), replicas, inner_name (the [optimizer]'s name)) -> Built.
Builder = Callable[..., Built]


@dataclass(frozen=True)
class Mode:
    name: str
    reads: tuple[str, ...]  # [flexdemo] keys it reads besides EVERY_MODE_KEYS
    separate_replicas: bool  # FSDP inside a replica only, flexdemo's exchange across replicas (else HSDP)
    elastic: bool  # can run replicas as separate torchft jobs
    state_bytes: Callable[[Any], StateBytes]
    checkpoint_items: Callable[[Any], dict]  # what its checkpoint tag records, besides the mode
    build: Builder
    inner_optimizer: bool  # builds torchtitan's [optimizer] (Adam/AdamW) inside each replica
    outer: str | None = None  # the outer step's compression ("dense", "topk"), None: no outer step
    outer_value_encodings: tuple[str, ...] = TOPK_ENCODINGS  # what outer_value_encoding may be
    lr_is_step_size: bool = False  # [optimizer] lr is the size of a sign step: must be finite and > 0
    ignores_optimizer_keys: tuple[str, ...] = ()
    check: Callable[[Any, Callable[[str], None]], None] = lambda cfg, fail: None  # its own key checks
    loss_keys: tuple[str, ...] = ()  # the keys its measured held-out loss depends on (the planner's evidence)
    reference: bool = False  # the baseline the others' loss and speed are measured against

    def in_flight(self, cfg) -> bool:
        """Whether a checkpoint of it holds an exchange in flight (DeMo's overlap)."""
        return "overlap" in self.reads and bool(cfg.overlap)


# -- off -------------------------------------------------------------------------------------

def _build_off(model_parts, cfg, group, inner, *, inner_name, **_) -> Built:
    cls, kwargs = inner
    logger.info(f"flexdemo: mode=off, {inner_name} + stock HSDP")
    return Built(cls, kwargs, per_replica_state=False)  # HSDP keeps the state identical across replicas


# -- demo ------------------------------------------------------------------------------------

def _demo_state(cfg) -> StateBytes:
    # DeMo's momentum "delta"; the look-ahead keeps the common parameters too
    momentum = MOMENTUM_BYTES[cfg.momentum_dtype]
    base = PARAM_BYTES if cfg.overlap and cfg.overlap_lookahead else 0
    return StateBytes(base, momentum) if cfg.momentum_device == "cpu" else StateBytes(momentum + base, 0)


def _demo_items(cfg) -> dict:
    from flexdemo.wire.format import WIRE_FORMAT_VERSION

    items = dict(topk=cfg.topk, chunk=cfg.chunk, value_encoding=cfg.value_encoding, overlap=cfg.overlap)
    if cfg.overlap_lookahead:  # its state holds the common parameters (named only when on: older tags stand)
        items.update(lookahead=True)
    if cfg.index_coding != "fixed":  # the bytes of an exchange in flight (overlap)
        items.update(index_coding=cfg.index_coding)
    if cfg.momentum_dtype != "float32":  # a bf16 momentum and its rounding counter (named only when on)
        items.update(momentum_dtype=cfg.momentum_dtype)
    if cfg.overlap:  # the exchange in flight is payload bytes: named from format 6 (none: 5 or earlier)
        items.update(payload_format=WIRE_FORMAT_VERSION)
    return items


def _demo_check(cfg, fail) -> None:
    if cfg.exchange == "sharded" and cfg.overlap:
        fail('overlap = true needs exchange = "allgather" (the sharded exchange runs two collectives with '
             "the owners' work between them; they cannot run behind the next step)")


def describe_exchange(cfg, topk: int) -> str:
    """The exchange for a log line: "allgather", or "sharded (top-N of the mean)"."""
    return "allgather" if cfg.exchange == "allgather" else f"sharded (top-{cfg.sharded_topk or topk} of the mean)"


def _build_demo(model_parts, cfg, group, inner, *, lr, steps, replicas, **_) -> Built:
    from flexdemo.optim import DeMo

    kwargs = {
        "lr": lr,
        "compression_decay": cfg.decay,
        "compression_topk": cfg.topk,
        "compression_chunk": cfg.chunk,
        "weight_decay": cfg.weight_decay,
        "replicate_group": group,
        "value_encoding": cfg.value_encoding,
        "overlap": cfg.overlap,
        "lookahead": cfg.overlap_lookahead,
        "kernel_precision": cfg.kernel_precision,
        "exchange_timeout": cfg.exchange_timeout_seconds or None,
        "nonfinite": cfg.nonfinite,
        "exchange": cfg.exchange,
        "sharded_topk": cfg.sharded_topk,
        "index_coding": cfg.index_coding,
        "momentum_dtype": cfg.momentum_dtype,
        "momentum_device": cfg.momentum_device,
    }
    logger.info(
        f"flexdemo: DeMo(topk={cfg.topk}, chunk={cfg.chunk}, decay={cfg.decay}, "
        f"values={cfg.value_encoding}, momentum={cfg.momentum_dtype} on {cfg.momentum_device}, "
        f"overlap={cfg.overlap}{', lookahead' if cfg.overlap_lookahead else ''}, "
        f"exchange={describe_exchange(cfg, cfg.topk)}) "
        f"over dp_replicate={replicas}"
    )
    return Built(DeMo, kwargs, per_replica_state=True,
                 container_kwargs={"last_step": steps, "max_consecutive_skips": cfg.max_consecutive_skips})


# -- diloco, demo_diloco ---------------------------------------------------------------------

def _outer_state(topk: bool) -> Callable[[Any], StateBytes]:
    def state(cfg) -> StateBytes:
        adam = 2 * PARAM_BYTES  # Adam/AdamW inside each replica: exp_avg, exp_avg_sq
        # DiLoCo (flexdemo.optim.diloco_outer.new_entry): global copy, outer momentum when
        # outer_momentum > 0, error feedback with top-k; on the GPU or in pinned host memory
        outer = PARAM_BYTES * (1 + (float(cfg.outer_momentum) > 0) + topk)
        return StateBytes(adam, outer) if cfg.outer_state_device == "cpu" else StateBytes(adam + outer, 0)
    return state


def _outer_items(topk: bool) -> Callable[[Any], dict]:
    def items(cfg) -> dict:
        out = dict(outer_momentum=cfg.outer_momentum > 0, outer_value_encoding=cfg.outer_value_encoding)
        if topk:
            out.update(outer_topk=cfg.outer_topk, outer_chunk=cfg.outer_chunk)
        return out
    return items


def _build_outer(topk: bool) -> Builder:
    def build(model_parts, cfg, group, inner, *, lr, steps, replicas, inner_name) -> Built:
        from flexdemo.optim.diloco import DiLoCo, outer_sgd

        if len(model_parts) != 1:  # validation rejects pipeline parallelism in these modes
            raise ValueError(f"mode={cfg.mode!r} needs one model part, got {len(model_parts)}")
        if steps % cfg.sync_interval:
            logger.warning(
                f"flexdemo: training.steps={steps} is not a multiple of sync_interval={cfg.sync_interval}: "
                f"the last {steps % cfg.sync_interval} steps end without an outer step, and the model "
                "saved last is each replica's own local one"
            )
        named = list(model_parts[0].named_parameters())
        cls, kwargs = inner
        kind = "DCT" if cfg.outer_transform == "dct" else "raw-value"
        compression = (
            f"{kind} top-k (topk={cfg.outer_topk}, chunk={cfg.outer_chunk}, decay={cfg.outer_decay}, "
            f"exchange={describe_exchange(cfg, cfg.outer_topk)})" if topk else "dense"
        )

        def outer_step(inner_optimizers: list):  # built once the container has made the inner optimizers
            outer = DiLoCo(
                named,
                outer_optimizer=outer_sgd([p for _, p in named], cfg.outer_lr, cfg.outer_momentum, cfg.outer_nesterov),
                sync_interval=cfg.sync_interval,
                compression="topk" if topk else "dense",
                value_encoding=cfg.outer_value_encoding,
                topk=cfg.outer_topk,
                chunk=cfg.outer_chunk,
                decay=cfg.outer_decay,
                replicate_group=group,
                state_device=cfg.outer_state_device,
                kernel_precision=cfg.kernel_precision,
                exchange_timeout=cfg.exchange_timeout_seconds or None,
                nonfinite=cfg.nonfinite,
                max_consecutive_skips=cfg.max_consecutive_skips,
                exchange=cfg.exchange,
                sharded_topk=cfg.sharded_topk,
                index_coding=cfg.index_coding,
                transform=cfg.outer_transform if topk else "dct",  # dense: not read, and said so (ignored keys)
                inner_optimizers=inner_optimizers,  # a discarded cycle resets their state
            )
            logger.info(
                f"flexdemo: mode={cfg.mode}: {inner_name} inside each replica, outer step every "
                f"{cfg.sync_interval} steps over dp_replicate={replicas}: {compression}, "
                f"{cfg.outer_value_encoding} values, SGD lr={cfg.outer_lr} momentum={cfg.outer_momentum} "
                f"nesterov={cfg.outer_nesterov}, state on {cfg.outer_state_device} "
                f"({outer.state_bytes_per_param()} bytes/param)"
            )
            return outer

        return Built(cls, kwargs, per_replica_state=True, outer=outer_step)  # each replica's Adam state is its own
    return build


def _outer_check(cfg, fail) -> None:
    if cfg.outer_nesterov and float(cfg.outer_momentum) == 0.0:
        fail("outer_nesterov=true needs outer_momentum > 0 (plain SGD: outer_nesterov=false, outer_momentum=0)")


# -- the registry ----------------------------------------------------------------------------

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("demo", _DEMO_KEYS, separate_replicas=True, elastic=True, state_bytes=_demo_state,
         checkpoint_items=_demo_items, build=_build_demo, inner_optimizer=False, lr_is_step_size=True,
         ignores_optimizer_keys=_OPTIMIZER_KEYS_DEMO_IGNORES, check=_demo_check,
         loss_keys=("exchange", "topk", "value_encoding", "overlap")),
    Mode("off", (), separate_replicas=False, elastic=False, state_bytes=lambda cfg: StateBytes(2 * PARAM_BYTES, 0),
         checkpoint_items=lambda cfg: {}, build=_build_off, inner_optimizer=True, reference=True),
    Mode("diloco", _OUTER_KEYS, separate_replicas=True, elastic=True, state_bytes=_outer_state(False),
         checkpoint_items=_outer_items(False), build=_build_outer(False), inner_optimizer=True, outer="dense",
         outer_value_encodings=DENSE_ENCODINGS, check=_outer_check,
         loss_keys=("sync_interval", "outer_value_encoding")),
    Mode("demo_diloco", (*_OUTER_KEYS, *_TOPK_OUTER_KEYS), separate_replicas=True, elastic=True,
         state_bytes=_outer_state(True), checkpoint_items=_outer_items(True), build=_build_outer(True),
         inner_optimizer=True, outer="topk", outer_value_encodings=TOPK_ENCODINGS, check=_outer_check,
         loss_keys=("exchange", "sync_interval", "outer_topk", "outer_value_encoding", "outer_transform",
                    "outer_lr")),
)}


def mode_of(cfg) -> Mode:
    """The entry of ``cfg.mode`` (a [flexdemo] section or anything with ``.mode``)."""
    try:
        return MODES[cfg.mode]
    except KeyError:
        raise ValueError(f"unknown flexdemo mode {cfg.mode!r}; expected one of {tuple(MODES)}") from None
