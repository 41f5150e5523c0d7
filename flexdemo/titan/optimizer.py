"""build_optimizers_fn for flexdemo train specs.

mode "demo":        DeMo on every model part (FSDP-sharded DTensor params; DeMo exchanges
                    compressed momentum over dp_replicate inside step()).
mode "diloco" /
mode "demo_diloco": torchtitan's Adam/AdamW from [optimizer] inside each replica, and the
                    DiLoCo outer step (dense / DCT top-k compressed) every sync_interval steps.
mode "off":         torchtitan's Adam/AdamW from [optimizer]; replicas are kept equal by HSDP.

All return a torchtitan ``OptimizersContainer`` subclass, so LR schedulers, DCP
checkpoints (flattened optimizer state dicts), step hooks and metrics work unchanged.
The container adds: per-step/cumulative replica-exchange accounting, the periodic
replica-identity check, and (DiLoCo modes) the outer step and its checkpointed state.

Skipped updates (a non-finite gradient in mode demo, a discarded cycle in the DiLoCo modes) are
logged, counted (``replica_exchange/skipped_steps``), and ``max_consecutive_skips`` of them in a
row stop every rank with an error naming the replicas and parameters. DiLoCo counts its own
outer steps; the per-step count is kept here.
"""

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from flexdemo.compression.plan import describe_blocks
from flexdemo.local import local_tensor
from flexdemo.optim.diloco import DiLoCo, RepeatedSkipsError, describe_nonfinite

from . import replicas as rep
from .checkpoint_format import Resume, format_key, format_tag, plan_resume
from .config import DILOCO_MODES, FlexDemoConfigError, flexdemo_section, ignored_keys, replica_local_loss
from .grad_scaling import scale_grads_to_replica_mean
from .parallelize import JOB_CONFIG_ATTR

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


def _replica_state_prefix(replica: int) -> str:
    return f"state@replica{replica}."


def _replica_outer_prefix(replica: int) -> str:
    return f"flexdemo.diloco@replica{replica}."


class FlexOptimizersContainer(OptimizersContainer):
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
        self.replica_prefix = (
            _replica_state_prefix(dist.get_rank(replicate_group))
            if per_replica_state and replicate_group is not None
            else None
        )
        self.replica = dist.get_rank(replicate_group) if replicate_group is not None else 0
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
        if synced:
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
            rep.verify_or_resync(self.model_parts, self.replicate_group, self.step_count, self.replica_check_action,
                                 shared)

    def _report_skipped_step(self) -> None:
        # DeMo learns of a skipped step without a host sync, so it may tell a step or so late
        # (at the run's last step it waits); steps are named by when they ran.
        last = self.last_step is not None and self.step_count == self.last_step
        skipped: dict[int, set[int]] = {}
        for o in self.optimizers:
            if hasattr(o, "pop_skipped_steps"):
                for ago, replicas in o.pop_skipped_steps(wait=last):
                    skipped.setdefault(self.step_count - ago, set()).update(replicas)
            elif getattr(o, "last_step_skipped_by", []):
                skipped.setdefault(self.step_count, set()).update(o.last_step_skipped_by)
        for step, replicas in sorted(skipped.items()):
            self.skipped_steps_total += 1
            logger.warning(f"flexdemo: step {step}'s update skipped on every replica: a non-finite "
                           f"gradient on replica(s) {sorted(replicas)} ({self.skipped_steps_total} skipped so far)")
        self._skips_to_count.update(skipped)
        # After step t every rank knows of every skipped step up to t - 1 (DeMo reads a step's
        # flags when the next one starts), of step t only maybe: counting up to t - 1 makes all
        # ranks stop at the same step (one stopping earlier would leave the others waiting in
        # the next exchange). The run's last step waited for its own flags.
        self._count_consecutive_skips(self.step_count if last else self.step_count - 1)
        if self.outer is not None and self.outer.last_sync_skipped and self.outer.inner_steps == 0:
            self._report_discarded_cycle()

    def _report_discarded_cycle(self) -> None:
        o = self.outer
        logger.warning(
            f"flexdemo: outer step after step {self.step_count} skipped on every replica ({o.skipped_syncs} "
            f"skipped so far, {o.consecutive_skips} in a row): non-finite parameters on "
            f"{describe_nonfinite(o.last_skipped_by)}; every replica restarts from the global copy "
            "with a fresh inner optimizer state"
        )

    def _count_consecutive_skips(self, through: int) -> None:
        for step in range(self._counted_through + 1, through + 1):
            replicas = self._skips_to_count.pop(step, None)
            if replicas is None:
                self._skip_streak = []
            else:
                self._skip_streak.append((step, replicas))
        self._counted_through = max(self._counted_through, through)
        limit = self.max_consecutive_skips
        if limit and len(self._skip_streak) >= limit:
            self._stop_repeated_skips()

    def _stop_repeated_skips(self) -> None:
        """Raise on every rank (all reach this at the same step) naming the replicas that flagged
        the skipped steps and, where this step's gradients are non-finite again, the parameters."""
        first, last = self._skip_streak[0][0], self._skip_streak[-1][0]
        replicas = sorted(set().union(*(r for _, r in self._skip_streak)))
        who = self._nonfinite_gradients()
        now = (f"; at step {self.step_count} non-finite gradients on {describe_nonfinite(who)}" if who
               else f"; step {self.step_count}'s gradients are finite")
        raise RepeatedSkipsError(
            f"flexdemo: {len(self._skip_streak)} steps in a row ({first}..{last}) skipped on every replica "
            f"(max_consecutive_skips = {self.max_consecutive_skips}): a non-finite gradient on replica(s) "
            f"{replicas}{now}; the fault repeats (bad data? a diverging lr?): stopping"
        )

    def _nonfinite_gradients(self) -> dict[int, list[str]]:
        """Replica -> the parameters whose gradient (this step's, still in ``.grad``) is non-finite
        on any of its ranks, gathered from every rank. After gradient clipping one non-finite
        gradient makes all of that replica's non-finite (the clip factor is NaN)."""
        mine = [name for part in self.model_parts for name, p in part.named_parameters()
                if p.grad is not None and not torch.isfinite(local_tensor(p.grad)).all()]
        everyone = [(self.replica, mine)]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.replica, mine))
        order = {name: i for i, (name, _) in enumerate(self.model_parts[0].named_parameters())}
        who: dict[int, set[str]] = {}
        for replica, names in everyone:
            if names:
                who.setdefault(replica, set()).update(names)
        return {r: sorted(names, key=lambda n: order.get(n, len(order))) for r, names in who.items()}

    def _overlapped(self):
        return [o for o in self.optimizers if getattr(o, "overlap", False)]

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
        return _replica_outer_prefix(self.replica)

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
        replicas = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
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


def _replicate_group(parallel_dims: ParallelDims):
    mesh = parallel_dims.get_optional_mesh("dp_replicate")
    return None if mesh is None else mesh.get_group()


def _job_config(model_parts: list[nn.Module]):
    job_config = getattr(model_parts[0], JOB_CONFIG_ATTR, None)
    if job_config is None:
        raise FlexDemoConfigError(
            "flexdemo optimizer builder needs a model parallelized by a flexdemo train spec "
            "(use [model] name = 'flexdemo_llama3' / 'flexdemo_qwen3')"
        )
    return job_config


def _adam_kwargs(optimizer_config, mode: str) -> tuple[type, dict[str, Any]]:
    """Same optimizer and kwargs as torchtitan's stock build_optimizers."""
    classes = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
    if optimizer_config.name not in classes:
        raise FlexDemoConfigError(
            f"[flexdemo] mode={mode!r} supports optimizer.name in {sorted(classes)}, got {optimizer_config.name!r}"
        )
    impl = optimizer_config.implementation
    return classes[optimizer_config.name], {
        "lr": optimizer_config.lr,
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "weight_decay": optimizer_config.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }


def _modelled_hsdp_allreduce_bytes(model_parts, parallel_dims: ParallelDims, reduce_dtype) -> int:
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


def build_flexdemo_optimizers(
    model_parts: list[nn.Module],
    optimizer_config,
    parallel_dims: ParallelDims,
    ft_manager=None,
) -> FlexOptimizersContainer:
    job_config = _job_config(model_parts)
    cfg = flexdemo_section(job_config)
    group = _replicate_group(parallel_dims)
    replicas, shards = parallel_dims.dp_replicate, parallel_dims.dp_shard * parallel_dims.cp
    checkpoint = {
        "format_key": format_key(format_tag(cfg), replicas, shards),
        "resume": plan_resume(job_config, cfg, replicas, shards, FlexDemoConfigError),
    }
    ignored = ignored_keys(job_config)
    if ignored:
        logger.warning(f"flexdemo: mode={cfg.mode} does not use {', '.join(ignored)} (set in the config; ignored)")

    if cfg.mode == "off":
        cls, kwargs = _adam_kwargs(optimizer_config, cfg.mode)
        modelled = _modelled_hsdp_allreduce_bytes(
            model_parts, parallel_dims, TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]
        )
        logger.info(f"flexdemo: mode=off, {optimizer_config.name} + stock HSDP")
        return FlexOptimizersContainer(
            model_parts, cls, kwargs,
            replicate_group=group,
            replica_check_interval=cfg.replica_check_interval,
            replica_check_action=cfg.replica_check_action,
            modelled_bytes_per_step=modelled,
            per_replica_state=False,  # HSDP keeps AdamW state identical across replicas
            **checkpoint,
        )

    # Every other mode keeps replicas apart: they must start identical, and see replica-mean gradients.
    _start_replicas_identical(model_parts, group, cfg.init_sync)
    scale_grads_to_replica_mean(model_parts, parallel_dims.dp_replicate, replica_local_loss(job_config))

    if cfg.mode in DILOCO_MODES:
        steps = job_config.training.steps
        if steps % cfg.sync_interval:
            logger.warning(
                f"flexdemo: training.steps={steps} is not a multiple of sync_interval={cfg.sync_interval}: "
                f"the last {steps % cfg.sync_interval} steps end without an outer step, and the model "
                "saved last is each replica's own local one"
            )
        return _build_diloco(model_parts, optimizer_config, parallel_dims, cfg, group, checkpoint)

    from flexdemo.optim import DeMo

    kwargs = {
        "lr": optimizer_config.lr,
        "compression_decay": cfg.decay,
        "compression_topk": cfg.topk,
        "compression_chunk": cfg.chunk,
        "weight_decay": cfg.weight_decay,
        "replicate_group": group,
        "value_encoding": cfg.value_encoding,
        "overlap": cfg.overlap,
        "kernel_precision": cfg.kernel_precision,
        "exchange_timeout": cfg.exchange_timeout_seconds or None,
        "nonfinite": cfg.nonfinite,
    }
    logger.info(
        f"flexdemo: DeMo(topk={cfg.topk}, chunk={cfg.chunk}, decay={cfg.decay}, "
        f"values={cfg.value_encoding}, overlap={cfg.overlap}) over dp_replicate={parallel_dims.dp_replicate}"
    )
    return FlexOptimizersContainer(
        model_parts, DeMo, kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=None,
        per_replica_state=True,
        last_step=job_config.training.steps,
        max_consecutive_skips=cfg.max_consecutive_skips,
        **checkpoint,
    )


def _start_replicas_identical(model_parts, group, init_sync: str) -> None:
    if group is None:
        return
    if init_sync == "broadcast":
        rep.broadcast_from_replica0(model_parts, group)
        logger.info("flexdemo: broadcast initial params from replica 0")
    elif init_sync == "verify":
        rep.verify_identical(model_parts, group, step=0)


def _build_diloco(model_parts, optimizer_config, parallel_dims: ParallelDims, cfg, group,
                  checkpoint: dict) -> FlexOptimizersContainer:
    if len(model_parts) != 1:  # validation rejects pipeline parallelism in these modes
        raise FlexDemoConfigError(f"mode={cfg.mode!r} needs one model part, got {len(model_parts)}")
    topk = cfg.mode == "demo_diloco"
    outer = DiLoCo(
        model_parts[0].named_parameters(),
        sync_interval=cfg.sync_interval,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        nesterov=cfg.outer_nesterov,
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
    )
    cls, kwargs = _adam_kwargs(optimizer_config, cfg.mode)
    compression = (
        f"DCT top-k (topk={cfg.outer_topk}, chunk={cfg.outer_chunk}, decay={cfg.outer_decay})" if topk else "dense"
    )
    logger.info(
        f"flexdemo: mode={cfg.mode}: {optimizer_config.name} inside each replica, outer step every "
        f"{cfg.sync_interval} steps over dp_replicate={parallel_dims.dp_replicate}: {compression}, "
        f"{cfg.outer_value_encoding} values, SGD lr={cfg.outer_lr} momentum={cfg.outer_momentum} "
        f"nesterov={cfg.outer_nesterov}, state on {cfg.outer_state_device} "
        f"({outer.state_bytes_per_param()} bytes/param)"
    )
    return FlexOptimizersContainer(
        model_parts, cls, kwargs,
        replicate_group=group,
        replica_check_interval=cfg.replica_check_interval,
        replica_check_action=cfg.replica_check_action,
        modelled_bytes_per_step=None,
        per_replica_state=True,  # each replica's AdamW state is its own
        outer=outer,
        **checkpoint,
    )
