"""What the replicas of one run must agree on, in one object the adapter makes once.

:class:`RunSettings` holds the ``[flexdemo]`` section (and through it the mode's entry,
flexdemo.modes) and the job settings every replica shares (model, batch, optimizer, schedule,
parallelism: the adapter names them, since they live in a torchtitan version's config). Its
readers:

* the checkpoint tag (:attr:`checkpoint_tag`): the settings without which a saved optimizer
  state cannot be read (the mode and what its entry records);
* the start-up agreement over a fixed replica group (:meth:`agree`): every item at once, a
  mismatch named in one line on every rank (a multi-node launch reads one config per node);
  the compressors and DiLoCo then compare what changes their decoded bits, each at its own
  construction (flexdemo.compression.agreement);
* an elastic replica's join (:meth:`items`, with what those compared): the joiner is refused on
  the first difference from the live peer it heals from.

Torchtitan-free: both adapters and the planner use it.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, fields
from typing import Any

import torch

from flexdemo.modes import Mode, mode_of

# Installed packages whose versions every replica must share.
PACKAGES = ("torch", "torchtitan", "torchft", "flexdemo")


@dataclass(frozen=True)
class RunSettings:
    section: Any  # the [flexdemo] section (flexdemo.section.FlexDemo)
    job: tuple[tuple[str, str], ...] = ()  # ("section.key", repr(value)) the adapter names

    @property
    def mode(self) -> Mode:
        return mode_of(self.section)

    @property
    def checkpoint_tag(self) -> str:
        items = {"mode": self.section.mode, **self.mode.checkpoint_items(self.section)}
        return ",".join(f"{k}={v}" for k, v in items.items())

    def items(self) -> list[tuple[str, str]]:
        """The ordered (name, value) settings replicas share: every [flexdemo] key, the job's,
        the installed packages and the GPU architecture."""
        out = [(f"flexdemo.{f.name}", repr(getattr(self.section, f.name))) for f in fields(self.section)]
        out += list(self.job)
        for package in PACKAGES:
            try:
                out.append((f"{package} version", importlib.metadata.version(package)))
            except importlib.metadata.PackageNotFoundError:
                out.append((f"{package} version", "not installed"))
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            out.append(("GPU architecture", f"sm_{major}{minor}"))
        return out

    def agree(self, group, device: torch.device) -> None:
        """Raise ReplicaSettingsMismatch on every rank unless every replica of ``group`` (a
        ReplicaGroup) holds the same :meth:`items`. Collective: every rank calls it, once."""
        from flexdemo.compression.agreement import check_settings_agree

        check_settings_agree("run settings", dict(self.items()), group, device)
