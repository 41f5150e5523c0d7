"""The ``[flexdemo]`` section: its keys (:class:`FlexDemo`, each documented where it is declared)
and the checks that need the section alone (:func:`check_section`). Torchtitan-free: each
torchtitan adapter puts the same dataclass into its own config (0.2.2: flexdemo.titan.config's
JobConfig) and adds the checks that need its other sections.

Fields with a fixed set of choices are ``Literal`` types: ``--help`` lists them and tyro rejects
a wrong value on the command line; :func:`check_section` checks the values that come from TOML
(which tyro takes as they are).
"""

# No `from __future__ import annotations`: torchtitan's config merger and tyro need real types.
import math
from dataclasses import dataclass, fields
from typing import Literal, Union, get_args

from flexdemo.compression.compressor import Exchange, KernelPrecision
from flexdemo.modes import MODES, mode_of
from flexdemo.optim.diloco_args import StateDevice, TopkEncoding
from flexdemo.wire.dct import Transform
from flexdemo.wire.format import IndexCoding, ValueEncoding

Mode = Literal[tuple(MODES)]  # flexdemo.modes: "demo", "off", "diloco", "demo_diloco"
NonFinite = Literal["skip", "stop"]
ReplicaCheckAction = Literal["stop", "resync"]
ReplicaCheckInterval = Union[int, Literal["auto"]]
InitSync = Literal["broadcast", "verify", "none"]
MemoryCheck = Literal["warn", "refuse", "off"]
MomentumDtype = Literal["float32", "bfloat16"]


class FlexDemoConfigError(ValueError):
    """A bad flexdemo/torchtitan configuration, detected before training."""



@dataclass
class FlexDemo:
    mode: Mode = "demo"
    """"demo": FSDP inside a replica + DeMo compressed exchange across replicas every step.
    "diloco": [optimizer] (AdamW) inside each replica, a dense outer step every sync_interval steps.
    "demo_diloco": as "diloco", with the outer exchange DCT/top-k compressed (outer_topk, ...).
    "off": torchtitan's stock HSDP + [optimizer] (AdamW) baseline, same launcher."""

    topk: int = 32
    """Coefficients kept per DCT block (per replica, per step)."""

    chunk: int = 64
    """Target DCT block edge; each dim uses its largest divisor <= chunk."""

    decay: float = 0.999
    """Momentum decay (beta) of the DeMo momentum."""

    value_encoding: ValueEncoding = "sign"
    """How kept coefficient values travel: "fp32", "bf16", "sign" (1 bit), "scaled_sign" (1 bit +
    one scale per block) or "two_bit" (a sign and a size bit + two levels per block). The last
    two keep what their quantization drops in the momentum (error feedback); two_bit runs on the
    torch path (no fused kernels)."""

    weight_decay: float = 0.0
    """Decoupled weight decay used by DeMo (the [optimizer] weight_decay is for mode "off")."""

    kernel_precision: KernelPrecision = "tf32x3"
    """GPU: matrix precision of the fused codec kernels' DCTs: "tf32x3" (three TF32 tensor-core
    products; on an H200 the same index sets as the torch path in every block checked and error
    feedback within 1e-6 of it, like "ieee", with a 1.5B-parameter DeMo step 31% faster) or
    "ieee" (fp32 products on the CUDA cores). Used by modes demo and demo_diloco."""

    momentum_dtype: MomentumDtype = "float32"
    """demo: the dtype DeMo keeps its momentum in. "bfloat16" halves it to 2 bytes per parameter:
    each step widens it to fp32, computes exactly as with "float32", and rounds back
    stochastically (keyed on each element's place in the whole tensor, so replicas, FSDP/TP
    layouts and resumed runs draw the same bits), so increments smaller than bf16's spacing are
    kept on average rather than lost (flexdemo.optim.momentum_storage)."""

    momentum_device: StateDevice = "device"
    """demo: where DeMo's momentum lives: "device" (beside the parameters) or "cpu" (pinned host
    memory: 0 bytes per parameter on the GPU; each step streams it through the GPU and back, the
    same bits, at the cost of a read and a write of it over the host link)."""

    overlap: bool = False
    """demo: apply each step's exchanged update one step later, so the exchange runs while the
    next forward/backward computes (the gradient then lags the update by one step). It costs
    loss: +18% held-out loss after 1000 steps of the small flavor at lr 1e-3 (docs/results.md
    1.2), for a 19% faster step over a 1 Gbit/s link. On NVLink it buys no speed (98.7% of
    AdamW-DDP's tokens/s against 99-101% without, 1B, 2 x H200: docs/results.md 1.3).
    overlap_lookahead recovers most of the loss."""

    overlap_lookahead: bool = False
    """demo with overlap = true: while a step's exchange is in flight, each replica trains on its
    own share of that update (its payload decoded alone), then goes back exactly to the common
    parameters when the whole update lands (Psyche's look-ahead, kept bit-identical across
    replicas). Held-out loss +0.5% / +2.1% over no overlap (two seeds, small, 1000 steps) where
    overlap alone costs +18.8% (docs/results.md 1.2). Costs a copy of the parameters (4 bytes
    each) and one more decode per step; replica checks and validation see the common parameters,
    which checkpoints keep in the optimizer state."""

    validation_same_batches: bool = True
    """With [validation] enabled on a dataset of torchtitan's: every validation scores the same
    held-out batches (torchtitan's validator otherwise continues its dataloader, so each validation
    scores different text). false = torchtitan's behaviour. flexdemo's held-out splits are always
    read as the same fixed windows (docs/data.md): false is refused for them."""

    replica_check_interval: ReplicaCheckInterval = "auto"
    """Every N steps verify that all replicas hold bit-identical parameters (0 = never). "auto":
    every REPLICA_CHECK_EVERY steps' worth of hashing, under 0.5% of a 1B step on an H100
    (replica_check_steps: 100 steps; in the DiLoCo modes a multiple of sync_interval)."""

    replica_check_action: ReplicaCheckAction = "stop"
    """When the check finds replicas different: "stop" every rank naming the first differing
    parameter, or "resync" every replica from replica 0 (logged) and go on."""

    init_sync: InitSync = "broadcast"
    """At start: "broadcast" params from replica 0, "verify" they match, or "none"."""

    nonfinite: NonFinite = "skip"
    """A non-finite gradient (demo) or non-finite parameters at an outer step (DiLoCo modes) on a
    replica: "skip" the step on every replica alike (nothing non-finite is sent), or "stop"
    every replica with an error naming it."""

    max_consecutive_skips: int = 10
    """nonfinite = "skip": this many updates in a row skipped (steps in mode demo, outer steps in
    the DiLoCo modes) stop every rank with an error naming the replicas and parameters: a fault
    that repeats (bad data every step or cycle) ends the run instead of training on without
    learning. 0 = never stop."""

    exchange_timeout_seconds: float = 0.0
    """Seconds an exchange over the replica group may take before the run stops with an error
    naming the group (a stalled or dead peer); 0 = the process group's own timeout
    ([comm] train_timeout_seconds)."""

    exchange: Exchange = "allgather"
    """How compressed payloads cross the replicas (demo, demo_diloco). "allgather": each replica
    receives every other's payload (exact DeMo; bytes per rank grow as W - 1 payloads).
    "sharded": each replica owns 1/W of the DCT blocks, averages what all sent for them and
    re-compresses the mean to sharded_topk per block (bf16 for 1-bit encodings; what it drops
    goes back into the senders' error feedback): two collectives per exchange, bytes per rank
    flat in W (a payload and the means). Not with overlap."""

    sharded_topk: int = 0
    """exchange = "sharded": coefficients of the mean kept per block; 0 = the mode's top-k (topk,
    or outer_topk). >= replicas x top-k keeps every coefficient any replica sent."""

    index_coding: IndexCoding = "fixed"
    """How the kept coefficients' positions travel (demo, demo_diloco). "fixed": 12 bits each in
    a 64x64 block. "elias_fano": each block's positions sorted and Elias-Fano coded, a size that
    depends on top-k only: 9 bits each at top-32 (-25%), 8 at 64, 10 at 16, 11 at 8, 12 at 4; the
    same decoded update bit for bit. On GPUs the fused kernels encode and decode, torch ops pack
    and unpack these indices."""

    sync_interval: int = 100
    """DiLoCo modes: inner steps between outer steps (H)."""

    outer_lr: float = 0.7
    """DiLoCo modes: outer SGD learning rate."""

    outer_momentum: float = 0.9
    """DiLoCo modes: outer SGD momentum (0 = plain SGD)."""

    outer_nesterov: bool = True
    """DiLoCo modes: Nesterov momentum in the outer SGD."""

    outer_value_encoding: TopkEncoding = "fp32"
    """DiLoCo modes: the outer exchange's values: "fp32" or "bf16" (diloco: the dense wire dtype;
    demo_diloco: the kept coefficients), "scaled_sign" (demo_diloco: 1 bit + a scale per block) or
    "two_bit" (demo_diloco: a sign and a size bit + two levels per block)."""

    outer_topk: int = 32
    """demo_diloco: coefficients kept per DCT block of the outer error-feedback buffer."""

    outer_chunk: int = 64
    """demo_diloco: target DCT block edge of the outer compression."""

    outer_decay: float = 0.9
    """demo_diloco: decay of the outer error-feedback buffer, in [0, 1]."""

    outer_transform: Transform = "dct"
    """demo_diloco: what each outer_chunk x outer_chunk block is top-k'd in: "dct" (DeMo-DiLoCo)
    or "none" (its raw values: SparseLoCo's rule, train_configs/*sparseloco*.toml)."""

    outer_state_device: StateDevice = "device"
    """DiLoCo modes: where the global copy, outer momentum and error feedback live: "device"
    (12 bytes/param on the GPU) or "cpu" (pinned host memory, streamed during the outer step)."""

    memory_check: MemoryCheck = "warn"
    """Before any rank starts, estimate the memory per GPU (flexdemo.titan.memory; one line) and,
    when it is over 90% of the GPU's: "warn", or "refuse" to start (a config error); "off": neither."""



def fail(msg: str) -> None:
    raise FlexDemoConfigError(f"[flexdemo] config error: {msg}")


def _check_types(c: FlexDemo) -> None:
    """Every key of the type its field declares: TOML values reach the section unchecked."""
    for f in fields(FlexDemo):
        value, kind = getattr(c, f.name), f.type
        choices = get_args(kind) if getattr(kind, "__origin__", None) is Literal else None
        if choices is not None:  # a fixed set of values (outer_value_encoding's depends on the mode: below)
            ok = isinstance(value, str) and (value in choices or f.name == "outer_value_encoding")
            expected = f"one of {choices}"
        elif kind is bool:
            ok, expected = isinstance(value, bool), "true or false"
        elif kind == ReplicaCheckInterval:
            ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool))
            expected = 'an integer or "auto"'
        elif kind is int:
            ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            expected = "a finite number"
        else:  # pragma: no cover - a field of a type this check does not know
            raise TypeError(f"FlexDemo.{f.name}: no check for type {kind}")
        if not ok:
            fail(f"{f.name}={value!r}; expected {expected}")


def check_section(c: FlexDemo) -> None:
    """Checks that need only the [flexdemo] section itself."""
    _check_types(c)
    if not isinstance(c.chunk, int) or c.chunk < 1:
        fail(f"chunk={c.chunk!r}; expected an integer >= 1")
    if not isinstance(c.topk, int) or c.topk < 1:
        fail(f"topk={c.topk!r}; expected an integer >= 1")
    if c.topk > c.chunk * c.chunk:
        fail(
            f"topk={c.topk} is larger than a chunk*chunk block "
            f"({c.chunk}*{c.chunk}={c.chunk * c.chunk})"
        )
    if not 0.0 <= float(c.decay) < 1.0:
        fail(f"decay={c.decay!r}; expected 0 <= decay < 1")
    if float(c.weight_decay) < 0.0:
        fail(f"weight_decay={c.weight_decay!r}; expected >= 0")
    if c.replica_check_interval != "auto" and c.replica_check_interval < 0:
        fail(f"replica_check_interval={c.replica_check_interval!r}; expected an integer >= 0 or \"auto\"")
    if not isinstance(c.max_consecutive_skips, int) or c.max_consecutive_skips < 0:
        fail(f"max_consecutive_skips={c.max_consecutive_skips!r}; expected an integer >= 0 (0 = never stop)")
    if not 0.0 <= float(c.exchange_timeout_seconds) < float("inf"):
        fail(f"exchange_timeout_seconds={c.exchange_timeout_seconds!r}; expected a finite number >= 0")
    if c.sharded_topk < 0:
        fail(f"sharded_topk={c.sharded_topk!r}; expected an integer >= 0 (0: the mode's top-k)")
    if c.overlap_lookahead and not c.overlap:
        fail("overlap_lookahead = true needs overlap = true (it stands in for the update still in flight)")
    mode_of(c).check(c, fail)
    _check_outer(c)


def _check_outer(c: FlexDemo) -> None:
    if not isinstance(c.sync_interval, int) or c.sync_interval < 1:
        fail(f"sync_interval={c.sync_interval!r}; expected an integer >= 1")
    if not float(c.outer_lr) > 0.0:
        fail(f"outer_lr={c.outer_lr!r}; expected > 0")
    if not 0.0 <= float(c.outer_momentum) < 1.0:
        fail(f"outer_momentum={c.outer_momentum!r}; expected 0 <= outer_momentum < 1")
    allowed = mode_of(c).outer_value_encodings
    if c.outer_value_encoding not in allowed:
        why = " (a bare sign would move every weight by outer_lr)" if c.outer_value_encoding == "sign" else ""
        fail(f"outer_value_encoding={c.outer_value_encoding!r} with mode={c.mode!r}; expected one of {allowed}{why}")
    if not isinstance(c.outer_chunk, int) or c.outer_chunk < 1:
        fail(f"outer_chunk={c.outer_chunk!r}; expected an integer >= 1")
    if not isinstance(c.outer_topk, int) or not 1 <= c.outer_topk <= c.outer_chunk * c.outer_chunk:
        fail(f"outer_topk={c.outer_topk!r}; expected an integer in [1, outer_chunk**2={c.outer_chunk ** 2}]")
    if not 0.0 <= float(c.outer_decay) <= 1.0:
        fail(f"outer_decay={c.outer_decay!r}; expected 0 <= outer_decay <= 1")


# The replica check hashes every tensor it compares (flexdemo.replica_check): 68 ms for 1.5 B
# fp32 parameters in llama3-1B shapes on an H100, a host tensor ~2.7x that (hashed on the GPU);
# docs/results/replica_check_h100. A 1B step: 8,192 tokens per GPU at ~52.5k tokens/s/GPU on
# 2 x H100 = 156 ms. Every 100 steps: 68 / (100 x 156) = 0.44% <= 0.5%.
REPLICA_CHECK_EVERY = 100
HOST_TENSOR_COST = 3  # a tensor in host memory, in units of one on the device (measured 2.7)


def replica_check_steps(c: FlexDemo) -> int:
    """The replica check's interval in steps, "auto" resolved: REPLICA_CHECK_EVERY steps per
    tensor hashed per parameter. In the DiLoCo modes the check also hashes the global copy (and
    the outer momentum), on the host with outer_state_device = "cpu", and runs right after an
    outer step only: the interval grows with that cost and is rounded up to a multiple of
    sync_interval (e.g. 300 with the defaults, 700 with the state on the host)."""
    if c.replica_check_interval != "auto":
        return c.replica_check_interval
    if mode_of(c).outer is None:
        return REPLICA_CHECK_EVERY
    state = (1 + (float(c.outer_momentum) > 0)) * (HOST_TENSOR_COST if c.outer_state_device == "cpu" else 1)
    steps = REPLICA_CHECK_EVERY * (1 + state)
    return -(-steps // c.sync_interval) * c.sync_interval
