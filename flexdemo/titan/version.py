"""Which torchtitan adapter runs: decided once, here, from the installed torchtitan's version
(read from its metadata, so nothing of torchtitan is imported to decide). 0.2.2: flexdemo.titan's
modules; 0.3.x: flexdemo.titan.v0_3."""

from __future__ import annotations

import importlib.metadata
import os

TORCHTITAN = importlib.metadata.version("torchtitan")
V0_2 = TORCHTITAN.startswith("0.2.")  # the TOML layer and the planner read configs with its ConfigManager
V0_3 = TORCHTITAN.startswith("0.3.")

_HERE = os.path.dirname(os.path.abspath(__file__))


def rank_module() -> str:
    """The module each rank runs (``python -m``)."""
    return "flexdemo.titan.v0_3.run" if V0_3 else "flexdemo.titan.run"


def rank_script() -> str:
    """The same as a path (torchrun's ``--run-path``, the CPU ranks forked from a forkserver)."""
    return os.path.join(_HERE, "v0_3", "run.py") if V0_3 else os.path.join(_HERE, "run.py")
