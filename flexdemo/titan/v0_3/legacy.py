"""The 0.3.0 config seen through 0.2.2's section names, for the version-independent readers that
take a 0.2.2 job config (flexdemo.titan.checkpoint's resume plan): only the fields they read (flexdemo.titan.checks, flexdemo.titan.checkpoint)."""

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
        validation=SimpleNamespace(enable=config.validator.enable,
                                   dataset=getattr(getattr(config.validator, "dataloader", None), "dataset", "")),
        flexdemo=config.flexdemo,
    )


def _lr(optimizer) -> float | None:
    groups = getattr(optimizer, "param_groups", None) or []
    return groups[0].optimizer_kwargs.get("lr") if groups else None
