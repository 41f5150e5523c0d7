"""Per mode: bytes each rank receives per step, seconds per step, tokens/s per GPU and memory per
GPU, for a parsed job config on a cluster of N nodes (one replica each) joined by B Gbit/s links.

Bytes come from the library's own payload formulas (flexdemo.compression: the bucket plan and
the exchange strategies' traffic, the dense DiLoCo exchange's; HSDP's modelled ring all-reduce),
for the shapes rank 0 holds (TP's share, then FSDP's dim-0 shard). Time per step:
  compute (+ the mode's optimizer extra) + link time + latency,
link time = the node's ranks' received bytes x 8 / B (its ranks share the node's link);
latency = ring hops x RTT / 2 per collective (an all_gather over W replicas: W - 1 hops, an
all-reduce 2 (W - 1)). AdamW's gradient all-reduce runs during the backward (the step is
the forward, then the longer of the backward, 2/3 of the compute, and the link);
``overlap = true`` runs demo's exchange beside the whole next step;
the DiLoCo modes' outer sync blocks, once per H steps. Memory: the start-up estimate
(flexdemo.titan.memory).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torchtitan.config import TORCH_DTYPE_MAP

from flexdemo.compression.allgather import AllGatherExchange
from flexdemo.compression.exchange import hsdp_allreduce_bytes, replica_mean_traffic
from flexdemo.compression.buckets import build_plan
from flexdemo.compression.sharded import ShardedExchange
from flexdemo.optim.bounded_groups import bounded_groups
from flexdemo.optim.diloco_args import WIRE_DTYPES
from flexdemo.optim.diloco_dense import DENSE_BUCKET_ELEMENTS
from flexdemo.titan import memory
from flexdemo.modes import mode_of
from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

from .evidence import FUSED_ENCODINGS, OUTER_STEP, LossCost, demo_step_extra, loss_cost

ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")  # torchtitan's TP plan shards these on dim 1


@dataclass(frozen=True)
class Cluster:
    nodes: int
    link_gbit: float
    rtt_ms: float
    gpus_per_node: int
    compute_seconds: float  # one AdamW training step on one GPU at the config's batch, no replica traffic
    device_memory: int | None  # bytes per GPU (None: fit not judged)
    device_name: str


@dataclass(frozen=True)
class Variant:
    """A mode with [flexdemo] keys set over the config's; ``preset``: the shipped config it copies."""
    mode: str
    keys: tuple[tuple[str, object], ...] = ()
    preset: str = ""


@dataclass
class Row:
    variant: Variant
    exchange: str  # allgather | sharded | dense | -
    settings: dict  # the row's [flexdemo] values that set its bytes and loss
    bytes_per_rank_per_step: float
    link_seconds: float  # per step, averaged over a DiLoCo cycle
    seconds_per_step: float
    tokens_per_s_per_gpu: float
    memory: int
    fits: bool | None  # None: no device memory known
    loss: LossCost | None

    def line(self) -> str:
        name = f" preset={self.variant.preset}" if self.variant.preset else ""
        loss = f" loss_vs_adamw={self.loss.text()}" if self.loss else \
            (" loss_vs_adamw=reference" if mode_of(self.variant).reference else " loss_vs_adamw=unmeasured")
        fit = "" if self.fits is None else (" fits" if self.fits else " does_not_fit")
        return (f"mode={self.variant.mode} exchange={self.exchange} bytes_per_rank_per_step={self.bytes_per_rank_per_step:.0f} "
                f"seconds_per_step={self.seconds_per_step:.4f} tokens_per_s_per_gpu={self.tokens_per_s_per_gpu:.0f} "
                f"memory_per_gpu_gib={self.memory / memory.GIB:.1f}{fit}{name} settings={_settings_text(self.settings)}{loss}")


def _settings_text(settings: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in settings.items()) or "-"


# SparseLoCo's recipe (gpu_2gpu_sparseloco.toml); its outer-lr-3 presets differ in outer_lr (and H, k) only.
_SPARSELOCO = (("sync_interval", 30), ("outer_transform", "none"), ("outer_topk", 64), ("outer_chunk", 64),
               ("outer_value_encoding", "two_bit"), ("outer_decay", 0.95), ("outer_lr", 1.0), ("outer_momentum", 0.0),
               ("outer_nesterov", False), ("exchange", "allgather"))
# demo_diloco's DCT recipe as the 4-GPU preset ships it; the H = 30 preset differs in H and outer lr only.
_DEMO_DILOCO_DCT = (("sync_interval", 16), ("outer_lr", 1.0), ("outer_momentum", 0.0), ("outer_nesterov", False),
                    ("outer_decay", 0.95), ("outer_value_encoding", "scaled_sign"), ("outer_topk", 256),
                    ("outer_chunk", 64), ("outer_transform", "dct"), ("exchange", "allgather"))


def _varied(keys: tuple, **changes) -> tuple:
    """``keys`` with some values changed, in the same order."""
    return tuple({**dict(keys), **changes}.items())


# The shipped presets' [flexdemo] keys (tests/test_plan.py checks them against train_configs/).
PRESETS = {v.preset: v for v in (
    Variant("demo", (("topk", 16), ("exchange", "allgather")), "gpu_2gpu_flexdemo_top16.toml"),
    Variant("demo_diloco", _DEMO_DILOCO_DCT, "gpu_4gpu_2x2_demo_diloco.toml"),
    Variant("demo_diloco", _varied(_DEMO_DILOCO_DCT, sync_interval=30, outer_lr=1.5), "gpu_2gpu_demo_diloco_h30.toml"),
    Variant("demo_diloco", _SPARSELOCO, "gpu_2gpu_sparseloco.toml"),
    Variant("demo_diloco", _varied(_SPARSELOCO, outer_lr=3.0), "gpu_2gpu_sparseloco_outer_lr3.toml"),
    Variant("demo_diloco", _varied(_SPARSELOCO, outer_lr=3.0, sync_interval=16, outer_topk=32),
            "gpu_2gpu_sparseloco_h16_top32.toml"),
)}
VARIANTS = (
    Variant("off"), Variant("demo", (("exchange", "allgather"),)), Variant("demo", (("exchange", "sharded"),)),
    Variant("diloco"), Variant("demo_diloco"), *PRESETS.values(),
)


def local_shapes(params, fsdp: int, tp: int) -> list[tuple[int, ...]]:
    """Rank 0's shard of every parameter: TP's share (torchtitan's llama3/qwen3 plan: 1-D
    weights replicated, wo / w2 on dim 1, other matrices on dim 0), then FSDP's dim-0 chunk."""
    out = []
    for name, shape in params:
        s = list(shape)
        if len(s) >= 2 and tp > 1:
            d = 1 if name.endswith(ROWWISE) else 0
            s[d] = -(-s[d] // tp)
        if s and fsdp > 1:
            s[0] = min(s[0], -(-s[0] // fsdp))
        out.append(tuple(s))
    return out


def check_interval(interval: int, sync_interval: int) -> int:
    """The DiLoCo modes compare replicas right after an outer step: the nearest multiple of H
    (0, off, stays off; no bytes change)."""
    return interval and sync_interval * max(1, round(interval / sync_interval))


def variant_keys(cfg, v: Variant) -> list[tuple[str, object]]:
    """The [flexdemo] keys the variant sets on ``cfg``: its mode, its keys and, in the DiLoCo
    modes, a replica check interval the config accepts for its H."""
    keys = [("mode", v.mode), *v.keys]
    if mode_of(v).outer is not None:
        h = dict(v.keys).get("sync_interval", cfg.sync_interval)
        keys.append(("replica_check_interval", check_interval(cfg.replica_check_interval, h)))
    return keys


def variant_config(job_config, v: Variant, c: Cluster):
    """The config with the variant's keys, one replica per node."""
    jc = copy.deepcopy(job_config)
    for k, val in variant_keys(jc.flexdemo, v):
        setattr(jc.flexdemo, k, val)
    p = jc.parallelism
    p.data_parallel_replicate_degree = c.nodes
    p.data_parallel_shard_degree = c.gpus_per_node // (p.tensor_parallel_degree * p.pipeline_parallel_degree)
    return jc


def _settings(cfg) -> dict:
    """The row's values of the keys its mode's measured loss depends on."""
    return {k: getattr(cfg, k) for k in mode_of(cfg).loss_keys}


def compressed_traffic(shapes, chunk: int, topk: int, encoding: str, index_coding: str, transform: str,
                       exchange: str, sharded_topk: int, world: int) -> int:
    """Bytes rank 0 receives in one compressed exchange (flexdemo.compression's strategies)."""
    entries = [[(None, s, torch.float32) for s in shapes if math.prod(s)]]
    buckets, _ = build_plan(entries, [chunk], [topk], encoding, index_coding, transform)
    if exchange == "sharded" and world > 1:
        return ShardedExchange(buckets, encoding, sharded_topk, world, rank=0).traffic().received
    return AllGatherExchange(buckets, encoding, world, rank=0).traffic().received


def dense_outer_traffic(shapes, world: int, encoding: str) -> int:
    """Bytes rank 0 receives in one dense outer exchange (flexdemo.optim.diloco_dense's buckets)."""
    sizes = [math.prod(s) for s in shapes if math.prod(s)]
    elem = torch.empty((), dtype=WIRE_DTYPES[encoding]).element_size()
    groups = bounded_groups(sizes, DENSE_BUCKET_ELEMENTS)
    return sum(replica_mean_traffic(sum(sizes[i] for i in g) + (b == 0), world, elem).received
               for b, g in enumerate(groups))


def plan_row(job_config, v: Variant, c: Cluster) -> Row:
    """One mode's row; raises FlexDemoConfigError where the config cannot run it."""
    jc = variant_config(job_config, v, c)
    world = c.nodes * c.gpus_per_node
    validate_job_config(jc, world)
    cfg, W = jc.flexdemo, c.nodes
    d = memory.degrees(jc, world)
    shapes = local_shapes(memory.shapes_of(jc).params, d.fsdp, d.tp)
    numel = sum(math.prod(s) for s in shapes)
    half_rtt = c.rtt_ms / 2000
    compute, hidden_by = c.compute_seconds, 0.0  # the share of the compute the link can run beside
    spec = mode_of(v)
    if not spec.separate_replicas:  # HSDP
        reduce = TORCH_DTYPE_MAP[jc.training.mixed_precision_reduce].itemsize
        received = hsdp_allreduce_bytes(numel, W, reduce)
        units = memory.shapes_of(jc).n_layers + 1  # one all-reduce per FSDP unit (layers, head)
        latency = units * 2 * (W - 1) * half_rtt
        exchange, hidden_by, per = "-", 2 / 3, 1  # the all-reduce runs beside the backward
    elif spec.outer is None:  # a compressed exchange every step
        received = compressed_traffic(shapes, cfg.chunk, cfg.topk, cfg.value_encoding, cfg.index_coding, "dct",
                                      cfg.exchange, cfg.sharded_topk, W)
        hops = (W - 1) + (1 if cfg.exchange == "sharded" else 0)  # sharded: an all_to_all, then an all_gather
        latency, exchange, per = hops * half_rtt, cfg.exchange, 1
        # sharded: a second encode/decode stage (the owners' means), counted as a second DeMo extra
        total = sum(math.prod(shape) for _, shape in memory.shapes_of(jc).params)
        compute += demo_step_extra(jc.model.flavor, numel, total) * (2 if cfg.exchange == "sharded" else 1)
        hidden_by = 1.0 if cfg.overlap else 0.0  # the exchange runs beside the next step
    elif spec.outer == "dense":
        received = dense_outer_traffic(shapes, W, cfg.outer_value_encoding)
        buckets = len(bounded_groups([math.prod(s) for s in shapes if math.prod(s)], DENSE_BUCKET_ELEMENTS))
        latency, exchange, per = buckets * W * half_rtt, "dense", cfg.sync_interval  # all_to_all + all_gather
        compute += OUTER_STEP["dense"].seconds_per_param * numel / per
    else:
        received = compressed_traffic(shapes, cfg.outer_chunk, cfg.outer_topk, cfg.outer_value_encoding,
                                      cfg.index_coding, cfg.outer_transform, cfg.exchange, cfg.sharded_topk, W)
        hops = (W - 1) + (1 if cfg.exchange == "sharded" else 0)
        latency, exchange, per = hops * half_rtt, cfg.exchange, cfg.sync_interval
        fused = cfg.outer_value_encoding in FUSED_ENCODINGS and cfg.outer_transform == "dct"
        compute += OUTER_STEP["topk_fused" if fused else "topk_torch"].seconds_per_param * numel / per
    bytes_per_step = received / per
    link = c.gpus_per_node * bytes_per_step * 8 / (c.link_gbit * 1e9) + latency / per
    seconds = (1 - hidden_by) * compute + max(hidden_by * compute, link)
    t = jc.training
    tokens = t.local_batch_size * t.seq_len / d.tp
    mem = memory.estimate_memory(jc, world, c.device_memory, c.device_name)
    fits = None if c.device_memory is None else not mem.over
    settings = _settings(cfg)
    return Row(v, exchange, settings, bytes_per_step, link, seconds, tokens / seconds, mem.total, fits,
               loss_cost(v.mode, settings))


def plan_rows(job_config, c: Cluster) -> tuple[list[Row], list[str]]:
    """Every variant's row (settings that repeat another row's are left out) and, per variant the
    config cannot run, one line saying why."""
    rows, skipped, seen = [], [], set()
    for v in VARIANTS:
        try:
            row = plan_row(job_config, v, c)
        except FlexDemoConfigError as e:
            skipped.append(f"mode={v.mode}{' preset=' + v.preset if v.preset else ''} not runnable: {e}")
            continue
        key = (v.mode, row.exchange, tuple(sorted(row.settings.items())))
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows, skipped
