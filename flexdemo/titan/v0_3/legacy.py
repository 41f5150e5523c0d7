"""The 0.3.0 config seen through 0.2.2's section names, for the version-independent readers that
take a 0.2.2 job config (flexdemo.titan.checks, flexdemo.titan.checkpoint's resume plan): only the
fields they read."""

from __future__ import annotations

from types import SimpleNamespace


def legacy_view(config) -> SimpleNamespace:
    dataloader = config.dataloader
    return SimpleNamespace(
        job=SimpleNamespace(dump_folder=config.dump_folder),
        checkpoint=config.checkpoint,
        parallelism=config.parallelism,
        training=SimpleNamespace(dataset=getattr(dataloader, "dataset", ""),
                                 dataset_path=getattr(dataloader, "dataset_path", "")),
        fault_tolerance=config.fault_tolerance,  # torchft's TorchFTManager.Config: 0.2.2's key names
        optimizer=SimpleNamespace(lr=_lr(config.optimizer), early_step_in_backward=False),
        validation=_validation(config),
        model=SimpleNamespace(hf_assets_path=config.hf_assets_path),
        flexdemo=config.flexdemo,
    )


def _validation(config) -> SimpleNamespace:
    """[validation] as 0.2.2 names it: its loader's own seq_len / batch where set, else the training's
    (what 0.3.0's Validator passes the loader)."""
    loader = getattr(config.validator, "dataloader", None)
    return SimpleNamespace(
        enable=config.validator.enable, dataset=getattr(loader, "dataset", ""),
        dataset_path=getattr(loader, "dataset_path", "") or "", steps=config.validator.steps,
        seq_len=getattr(loader, "validation_seq_len", 0) or config.training.seq_len,
        local_batch_size=getattr(loader, "validation_local_batch_size", 0) or config.training.local_batch_size)


def _lr(optimizer) -> float | None:
    groups = getattr(optimizer, "param_groups", None) or []
    return groups[0].optimizer_kwargs.get("lr") if groups else None
