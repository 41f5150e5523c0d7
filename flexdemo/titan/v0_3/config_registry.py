"""torchtitan 0.3.0's own way to name a run: ``--module flexdemo.titan.v0_3 --config cpu_2x2_flexdemo``
(torchtitan's ConfigManager imports ``<module>.config_registry`` and calls the function). One
function per CPU config in train_configs/, each read from its TOML through the same reader as
flexdemo's launcher (toml_config), so the TOML stays the one source of truth.

Importing this module applies the CPU shim where there is no GPU: under torchtitan's own entry
point (``torchrun ... -m torchtitan.train --module flexdemo.titan.v0_3 --config ...``) nothing of
flexdemo runs earlier, and the shim patches what torchtitan reads at call time.
"""

from __future__ import annotations

import os

from . import cpu_shim
from .toml_config import read

cpu_shim.apply()

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "train_configs")


def _from_toml(name: str):
    return read(os.path.join(CONFIGS, f"{name}.toml"))


def cpu_2x2_flexdemo():
    return _from_toml("cpu_2x2_flexdemo")


def cpu_2x2_hsdp_adamw():
    return _from_toml("cpu_2x2_hsdp_adamw")


def cpu_2x2_diloco():
    return _from_toml("cpu_2x2_diloco")


def cpu_2x2_demo_diloco():
    return _from_toml("cpu_2x2_demo_diloco")


def cpu_elastic_demo():
    """One elastic replica (torchft): ``--fault_tolerance.replica_id I`` per job, $TORCHFT_LIGHTHOUSE set."""
    return _from_toml("cpu_elastic_demo")
