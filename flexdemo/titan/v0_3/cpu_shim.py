"""CPU shim for torchtitan 0.3.0 -- applied ONLY when no GPU is available (flexdemo.titan.cpu_shim
for the shared part: the torch.cuda-like device module, gloo's SUM reductions, the exit).

What 0.3.0 adds to 0.2.2's needs (measured, /work/notes/tt030.md e):
* its own list of modules that copy ``device_type``/``device_module`` by name;
* ``torch.distributed.set_timeout``, which 0.3.0 calls after step 1 and torch 2.13 lacks:
  torch's private ``_set_pg_timeout`` has the same signature.
"""

from __future__ import annotations

import torch.distributed as dist

from flexdemo.titan import cpu_shim as shared
from flexdemo.titan.cpu_shim import active, exit_without_teardown, fix_fsdp_for_gloo, needed  # noqa: F401

NAME_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiler",
    "torchtitan.models.common.token_dispatcher",
)


def apply() -> None:
    """Point torchtitan 0.3.0 at the CPU; idempotent, a no-op with a GPU. Patches module globals
    that torchtitan reads at call time, so it may run after torchtitan is imported."""
    if not needed():
        return
    shared.apply(NAME_COPIES)
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
