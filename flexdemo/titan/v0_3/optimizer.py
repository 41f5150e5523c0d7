"""flexdemo's optimizers container on torchtitan 0.3.0: the trainer builds ``config.optimizer``
(0.2.2: TrainSpec.build_optimizers_fn), so the Config put there names this class.

What each mode builds is its entry in flexdemo.modes; what happens around the optimizers' step is
flexdemo.titan.container's (shared with 0.2.2). What differs from 0.2.2:
* the inner optimizer ([optimizer] Adam/AdamW of modes off/diloco/demo_diloco) is the one entry of
  ``param_groups`` (a TOML's [optimizer] becomes it, toml_config.py);
* 0.3.0 hands the container its Config and the model parts only: the run's config and
  ParallelDims come through :class:`FlexRun` (``config.run``, set by FlexTrainer; not on the CLI);
* 0.3.0's state_dict/load_state_dict make missing optimizer state by running each optimizer's
  step() at lr 0: with DeMo that is an exchange with every replica. :class:`_StateWithoutStep`
  makes DeMo's state directly instead (Adam/AdamW: torchtitan's way, which touches nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch
import torch.nn as nn
import tyro
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                   load_flat_optim_state_dict)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from flexdemo.local import local_tensor
from flexdemo.modes import EVERY_MODE_KEYS, mode_of
from flexdemo.replica_group import replica_group
from flexdemo.section import FlexDemoConfigError

from .. import elastic
from .. import replicas as rep
from ..checkpoint import format_key, plan_resume
from ..container import FlexContainer
from ..meters import modelled_hsdp_allreduce_bytes
from .legacy import legacy_view
from .settings import run_settings

ADAM = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


class FlexRun:
    """What the container needs beyond its Config: the trainer's config, and its ParallelDims
    (FlexTrainer.init_distributed fills it in, before the model is built)."""

    def __init__(self, config: Any) -> None:
        self.config, self.parallel_dims = config, None

    def to_dict(self) -> str:  # torchtitan serialises the config tree (it holds this run's config: no recursion)
        return "FlexRun"


def _materialise(optim: torch.optim.Optimizer) -> None:
    if hasattr(optim, "_create_state"):  # flexdemo's DeMo: its state made without a step (no exchange)
        if not optim.state:
            optim._create_state()
    else:
        init_optim_state(optim)


class _StateWithoutStep(OptimizersContainer):
    """torchtitan 0.3.0's flat FQN-keyed optimizer state dict, its missing state made without a DeMo step."""

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for optim in self.optimizers:
            _materialise(optim)
            out.update(get_flat_optim_state_dict(optim))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optim in self.optimizers:
            _materialise(optim)
            load_flat_optim_state_dict(optim, state_dict)


class FlexOptimizersContainer(FlexContainer, _StateWithoutStep):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        run: Annotated[Any, tyro.conf.Suppress] = None
        """The run's FlexRun (set by FlexTrainer; not a setting)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        run: FlexRun = config.run
        if run is None or run.parallel_dims is None:
            raise FlexDemoConfigError("flexdemo's optimizers need flexdemo's trainer (FlexTrainer.Config)")
        cfg, pd, settings = run.config, run.parallel_dims, run_settings(run.config)
        section, spec = settings.section, settings.mode
        process_group = rep.replicate_group(pd)
        group = None if process_group is None else replica_group(process_group)
        replica_index = None
        if elastic.enabled(cfg):  # torchft's group over the replicas' jobs (flexdemo.titan.elastic)
            group, replica_index = elastic.elastic_group(cfg), cfg.fault_tolerance.replica_id
        replicas, shards = pd.dp_replicate, pd.dp_shard * pd.cp
        if group is not None:  # every setting at once, before the optimizers compare their own
            settings.agree(group, local_tensor(next(model_parts[0].parameters())).device)
        name, kwargs = inner_optimizer(config)
        built = spec.build(model_parts, section, group, (ADAM.get(name), kwargs) if spec.inner_optimizer else None,
                           lr=kwargs["lr"], steps=cfg.training.steps, replicas=replicas, inner_name=name)
        self.model_parts = model_parts
        self.optimizers = [built.optimizer_cls(_groups(part), **built.optimizer_kwargs) for part in model_parts]
        self._post_init([p for part in model_parts for p in part.parameters() if p.requires_grad])
        modelled = None if spec.separate_replicas else modelled_hsdp_allreduce_bytes(
            model_parts, pd, TORCH_DTYPE_MAP[cfg.training.mixed_precision_reduce])
        self.setup_flex(
            model_parts, replicate_group=group, replica_check_interval=section.replica_check_interval,
            replica_check_action=section.replica_check_action, modelled_bytes_per_step=modelled,
            per_replica_state=built.per_replica_state, run_settings=settings, outer=built.outer,
            format_key=format_key(settings.checkpoint_tag, replicas, shards),
            resume=plan_resume(legacy_view(cfg), settings, replicas, shards, FlexDemoConfigError),
            job_replicas=replicas, replica_index=replica_index, **built.container_kwargs)
        ignored = ignored_keys(section, config)
        if ignored:
            logger.warning(f"flexdemo: mode={section.mode} does not use {', '.join(ignored)} (set in the config; ignored)")


def _groups(part: nn.Module) -> list[dict[str, Any]]:
    """One param group per model part, named by FQN (0.3.0's flat optimizer state is FQN-keyed)."""
    named = [(canonical_fqn(n), p) for n, p in part.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]


def inner_optimizer(config) -> tuple[str, dict[str, Any]]:
    """The [optimizer] (Adam/AdamW) of the one param group flexdemo's configs have, with
    torchtitan's implementation kwargs; lr alone is read by DeMo."""
    if len(config.param_groups) != 1 or config.param_groups[0].pattern not in (".*", r".*"):
        raise FlexDemoConfigError("flexdemo's optimizers take one param group (pattern '.*') on torchtitan 0.3.0")
    group = config.param_groups[0]
    if group.optimizer_name not in ADAM:
        raise FlexDemoConfigError(f"optimizer name {group.optimizer_name!r}: flexdemo supports {sorted(ADAM)}")
    return group.optimizer_name, {**group.optimizer_kwargs, **OptimizersContainer._build_impl_kwargs(config)}


# 0.2.2's [optimizer] defaults (its keys) and where 0.3.0's one param group holds them.
OPTIMIZER_KEYS = {
    "name": ("AdamW", lambda g, c: g.optimizer_name),
    "beta1": (0.9, lambda g, c: tuple(g.optimizer_kwargs.get("betas", (0.9, 0.95)))[0]),
    "beta2": (0.95, lambda g, c: tuple(g.optimizer_kwargs.get("betas", (0.9, 0.95)))[1]),
    "eps": (1e-8, lambda g, c: g.optimizer_kwargs.get("eps", 1e-8)),
    "weight_decay": (0.1, lambda g, c: g.optimizer_kwargs.get("weight_decay", 0.1)),
    "implementation": ("fused", lambda g, c: c.implementation),
}


def ignored_keys(section, optimizer_config=None) -> list[str]:
    """``section.key`` (0.2.2's names) of every key set to a non-default value that the mode does not
    read, as 0.2.2's flexdemo.titan.optimizer.ignored_keys: [flexdemo] keys, and the [optimizer] keys
    DeMo does not read (everything but lr)."""
    from dataclasses import fields

    spec = mode_of(section)
    used = {*EVERY_MODE_KEYS, *spec.reads}
    out = [f"flexdemo.{f.name}" for f in fields(section) if f.name not in used and getattr(section, f.name) != f.default]
    groups = getattr(optimizer_config, "param_groups", None) or []
    if groups:
        out += [f"optimizer.{k}" for k in spec.ignores_optimizer_keys
                if k in OPTIMIZER_KEYS and OPTIMIZER_KEYS[k][1](groups[0], optimizer_config) != OPTIMIZER_KEYS[k][0]]
    return out
