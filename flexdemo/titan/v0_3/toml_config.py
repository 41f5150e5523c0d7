"""A flexdemo TOML config (0.2.2's format: train_configs/*.toml) and its ``--section.key value``
overrides, read into torchtitan 0.3.0's config (a ``FlexTrainer.Config``).

0.3.0 has no TOML configs and renamed what flexdemo's configs set; :data:`KEYS` is every key this
reader takes, each with its type, and :func:`build` says where it goes (``job.dump_folder`` ->
``dump_folder``, ``model.name/flavor`` -> ``model_spec``, ``optimizer.*`` -> the one param group's
kwargs, ``training.dataset`` -> ``dataloader``, ``validation.*`` -> ``validator``, ...). A key it
does not take is refused with one line (FlexDemoConfigError), never ignored. Overrides use 0.2.2's
spellings, booleans as ``--x true/false``, ``--x`` or ``--x.no_x``/``--section.no-key``; they are
applied to the TOML's table, so they go through the same mapping and checks.
"""

from __future__ import annotations

import tomllib
from dataclasses import fields
from typing import Any

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import CommConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.experiments.torchft import TorchFTManager
from torchtitan.models.common.config_utils import decoder_vocab_size

from flexdemo.data.assets import ensure_assets
from flexdemo.data.dataset import SPLITS
from flexdemo.data.tokenizer import has_tokenizer
from flexdemo.section import FlexDemo, FlexDemoConfigError

from .data import FlexDataLoader, TextDataLoader
from .heldout import HeldOutLoader
from .metrics import FlexMetricsProcessor
from .model import model_spec
from .optimizer import FlexOptimizersContainer
from .trainer import FlexTrainer

# Read and dropped: what 0.3.0 has no place for and needs none (the extension hooks of 0.2.2).
DROPPED = {("job", "description"), ("job", "custom_config_module"), ("experimental", "custom_import")}
# Kept the same name in 0.3.0's section of the same name.
SAME = {
    "training": {"local_batch_size": int, "global_batch_size": int, "seq_len": int, "steps": int,
                 "max_norm": float, "mixed_precision_param": str, "mixed_precision_reduce": str},
    "parallelism": {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
                    "tensor_parallel_degree": int, "pipeline_parallel_degree": int,
                    "context_parallel_degree": int, "expert_parallel_degree": int,
                    "fsdp_reshard_after_forward": str, "spmd_backend": str},
    "lr_scheduler": {"warmup_steps": int, "decay_ratio": float, "decay_type": str, "min_lr_factor": float},
    "checkpoint": {"enable": bool, "folder": str, "interval": int, "keep_latest_k": int, "load_step": int,
                   "initial_load_path": str, "initial_load_model_only": bool, "last_save_model_only": bool,
                   "exclude_from_loading": list},
    "metrics": {"log_freq": int, "enable_tensorboard": bool, "save_tb_folder": str, "enable_wandb": bool,
                "disable_color_printing": bool},
    "comm": {"init_timeout_seconds": int, "train_timeout_seconds": int},
    # elastic replicas (flexdemo.titan.elastic): 0.3.0's TorchFTManager.Config has 0.2.2's keys
    "fault_tolerance": {"enable": bool, "replica_id": int, "group_size": int, "min_replica_size": int,
                        "process_group": str, "process_group_timeout_ms": int, "semi_sync_method": str},
}
# Renamed or moved (see build()).
MOVED = {
    "job": {"dump_folder": str},
    "model": {"name": str, "flavor": str, "hf_assets_path": str},
    "optimizer": {"name": str, "lr": float, "eps": float, "weight_decay": float, "beta1": float, "beta2": float,
                  "implementation": str},
    "training": {"dataset": str, "dataset_path": str},
    "activation_checkpoint": {"mode": str},
    "validation": {"enable": bool, "freq": int, "steps": int, "dataset": str, "dataset_path": str,
                   "local_batch_size": int, "seq_len": int},
    "debug": {"seed": int},
}
KEYS: dict[str, dict[str, Any]] = {s: {**SAME.get(s, {}), **MOVED.get(s, {})} for s in {*SAME, *MOVED}}
KEYS["flexdemo"] = {f.name: f.type for f in fields(FlexDemo)}
# 0.2.2's defaults where 0.3.0 has none or another (the [optimizer] section's).
OPTIMIZER_DEFAULTS = {"name": "AdamW", "lr": 8e-4, "eps": 1e-8, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95,
                      "implementation": "fused"}


def read(path: str, overrides: list[str] = ()) -> FlexTrainer.Config:
    """The TOML at ``path`` with ``overrides`` applied, as a 0.3.0 FlexTrainer.Config."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise FlexDemoConfigError(f"cannot read config {path}: {e}") from e
    for (section, key), raw in parse_overrides(list(overrides)):
        table.setdefault(section, {})[key] = _typed(section, key, raw)
    for section, keys in table.items():
        if not isinstance(keys, dict):
            _refuse(section, None)
        for key, value in keys.items():
            if (section, key) not in DROPPED:
                keys[key] = _check_type(section, key, value)
    return build(table)


def parse_overrides(argv: list[str]) -> list[tuple[tuple[str, str], Any]]:
    """``--section.key value`` pairs (0.2.2's CLI): a flag with no value is true, ``no_``/``no-``
    before the key false. A value is a string until :func:`_typed` reads it."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise FlexDemoConfigError(f"override {arg!r}: expected --section.key value (0.2.2's spelling)")
        name, _, inline = arg[2:].partition("=")
        section, key = name.split(".", 1)
        key = key.replace("-", "_")
        if inline:
            value, i = inline, i + 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = argv[i + 1], i + 2
        elif key.startswith("no_") and key[3:] in KEYS.get(section, {}):
            key, value, i = key[3:], "false", i + 1
        else:
            value, i = "true", i + 1
        out.append(((section, key), value))
    return out


def _typed(section: str, key: str, raw: str) -> Any:
    kind = KEYS.get(section, {}).get(key)
    if kind is None:
        _refuse(section, key)
    if kind is bool:
        if raw.lower() not in ("true", "false"):
            raise FlexDemoConfigError(f"--{section}.{key} {raw!r}: expected true or false")
        return raw.lower() == "true"
    if kind is list:
        return [v for v in raw.split(",") if v]
    if kind in (int, float, str):
        return raw if kind is str else _number(section, key, raw, kind)
    return _literal(raw)  # [flexdemo]'s Literal / int | "auto" keys: check_section checks the value


def _literal(raw: str) -> Any:
    """A TOML value (5, 0.5, true), else the string itself ("auto", "bf16")."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _number(section, key, raw, kind):
    try:
        return kind(float(raw)) if kind is int and float(raw).is_integer() else kind(raw)
    except ValueError:
        raise FlexDemoConfigError(f"--{section}.{key} {raw!r}: expected a {kind.__name__}") from None


def _check_type(section: str, key: str, value: Any) -> Any:
    kind = KEYS.get(section, {}).get(key)
    if kind is None:
        _refuse(section, key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float, str, bool, list) and not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FlexDemoConfigError(f"[{section}] {key} = {value!r}: expected a {kind.__name__}")
    return value  # [flexdemo] values: flexdemo.section.check_section checks them


def _refuse(section: str, key: str | None) -> None:
    where = f"[{section}] {key}" if key else f"[{section}]"
    known = ", ".join(sorted(KEYS.get(section, {}))) or "none (sections: " + ", ".join(sorted(KEYS)) + ")"
    raise FlexDemoConfigError(f"{where} is not supported on torchtitan 0.3.0 by flexdemo's TOML reader "
                              f"(never ignored; its keys there: {known})")


def build(t: dict[str, dict[str, Any]]) -> FlexTrainer.Config:
    """The 0.3.0 config of a checked TOML table (0.2.2 section names)."""
    job, model, opt = t.get("job", {}), t.get("model", {}), {**OPTIMIZER_DEFAULTS, **t.get("optimizer", {})}
    training, val, debug = t.get("training", {}), t.get("validation", {}), t.get("debug", {})
    spec = model_spec(model.get("name", "flexdemo_llama3"), model.get("flavor", "debugmodel"))
    seed = debug.get("seed")
    dataset = training.get("dataset", "flexdemo_stdlib")
    cfg = FlexTrainer.Config(
        model_spec=spec,
        dump_folder=job.get("dump_folder", "./outputs"),
        hf_assets_path=_assets(model.get("hf_assets_path", ""), dataset, training.get("dataset_path", "")),
        tokenizer=HuggingFaceTokenizer.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=FlexOptimizersContainer.Config(
            implementation=opt["implementation"],
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=opt["name"], optimizer_kwargs={
                "lr": opt["lr"], "betas": (opt["beta1"], opt["beta2"]), "eps": opt["eps"],
                "weight_decay": opt["weight_decay"]})]),
        lr_scheduler=LRSchedulersContainer.Config(**t.get("lr_scheduler", {})),
        # 0.3.0 wraps forward-backward in CUDA graphs by default; 0.2.2 (and flexdemo's exchange) did not.
        training=TrainingConfig(**{k: v for k, v in training.items() if k in SAME["training"]},
                                disable_cuda_graphs=True),
        # partial_dtensor: meshes named as 0.2.2's (dp_replicate, fsdp); FSDP on the fsdp sub-mesh works.
        parallelism=ParallelismConfig(**{"spmd_backend": "partial_dtensor", **t.get("parallelism", {})}),
        dataloader=_dataloader(dataset, training.get("dataset_path", ""), seed),
        activation_checkpoint=_activation_checkpoint(t.get("activation_checkpoint", {}).get("mode", "selective")),
        checkpoint=CheckpointManager.Config(**t.get("checkpoint", {})),
        metrics=FlexMetricsProcessor.Config(**t.get("metrics", {})),
        comm=CommConfig(**t.get("comm", {})),
        debug=DebugConfig(seed=seed),
        flexdemo=FlexDemo(**t.get("flexdemo", {})),
        fault_tolerance=TorchFTManager.Config(**t.get("fault_tolerance", {})),
    )
    if val:
        cfg.validator = _validator(val, cfg.training, t.get("parallelism", {}))
    return cfg


def _dataloader(dataset: str, dataset_path: str, seed: int | None):
    """flexdemo's corpus for its datasets (seeded with [debug] seed, as 0.2.2 seeds it), torchtitan's
    HF text loader for any other (as 0.2.2's build_dataloader)."""
    if dataset.lower() in SPLITS:
        return FlexDataLoader.Config(dataset=dataset, dataset_path=dataset_path, seed=seed or 0)
    return TextDataLoader.Config(dataset=dataset, dataset_path=dataset_path or None)


def _validator(val: dict[str, Any], training, parallelism: dict[str, Any]) -> Validator.Config:
    """[validation] -> 0.3.0's validator: flexdemo's held-out windows (heldout.py) or torchtitan's HF
    text loader. 0.3.0's Validator hands its loader the training's batch and sequence; 0.2.2's
    [validation] local_batch_size / seq_len go to the loader's Config instead (what 0.2.2 does with
    them; with pipeline parallelism the Validator also counts microbatches by the training's batch:
    other values refused there)."""
    own = {key: val[key] for key in ("local_batch_size", "seq_len") if key in val and val[key] != getattr(training, key)}
    if own and parallelism.get("pipeline_parallel_degree", 1) > 1:
        key = next(iter(own))
        raise FlexDemoConfigError(f"[validation] {key} = {own[key]}: with pipeline parallelism torchtitan 0.3.0 "
                                  f"validates with the training's ({getattr(training, key)}); remove the key or "
                                  "make them equal")
    dataset = val.get("dataset", "flexdemo_stdlib_validation")
    steps = val.get("steps", -1)
    own = {f"validation_{key}": value for key, value in own.items()}  # the loaders' Config fields
    if dataset.lower() in SPLITS:
        loader = HeldOutLoader.Config(dataset=dataset, dataset_path=val.get("dataset_path", ""), steps=steps, **own)
    else:
        loader = TextDataLoader.Config(dataset=dataset, dataset_path=val.get("dataset_path") or None, **own)
    return Validator.Config(enable=val.get("enable", False), freq=val.get("freq", 10), steps=steps, dataloader=loader)


def _activation_checkpoint(mode: str):
    choices = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
    if mode not in choices:
        raise FlexDemoConfigError(f"[activation_checkpoint] mode = {mode!r}: expected one of {sorted(choices)}")
    return choices[mode] and choices[mode]()


def _assets(path: str, dataset: str, dataset_path: str) -> str:
    """hf_assets_path: the config's where it holds a tokenizer, else flexdemo's embedded one (as
    0.2.2's flexdemo.titan.data.embedded_tokenizer_dir: built on first use)."""
    if path and (has_tokenizer(path) or dataset.lower() not in SPLITS):
        return path  # a tokenizer it lacks is refused by settings.validate (at launch, not when read)
    corpus = SPLITS.get(dataset.lower(), ("stdlib", None))[0]
    return ensure_assets(dataset_path or None, corpus=corpus) if dataset_path else ensure_assets(corpus=corpus)
