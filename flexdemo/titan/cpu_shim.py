"""CPU shim for torchtitan 0.2.2 -- used ONLY when no GPU is available.

torchtitan picks its device at import time (``torchtitan.tools.utils.device_type``)
and silently falls back to "cuda" without a GPU.  A few modules copy that value
by name.  This shim points all of them at the CPU and gives torchtitan the small
``torch.cuda``-like surface it calls (memory stats, device name, ...).

It also provides ``fix_fsdp_for_gloo``: gloo has no ``ReduceOp.PREMUL_SUM``, so FSDP
modules must be told to use plain SUM reductions (division done separately); and
``exit_without_teardown`` for gloo processes that have finished.

Nothing here is used on GPU machines.
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import sys
import types

import torch

# Modules that did ``from torchtitan.tools.utils import device_type/device_module``.
_NAME_COPIES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.tools.profiling",
)

_active = False


def needed() -> bool:
    """True when the shim should be applied (no CUDA device)."""
    return not torch.cuda.is_available()


def active() -> bool:
    return _active


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _cpu_device_module() -> types.SimpleNamespace:
    """torch.cpu-like module with the torch.cuda-style calls torchtitan makes.
    Memory "stats" report the process's peak RSS against host memory."""

    class _Props:
        total_memory = _host_memory_bytes()

    def memory_stats(*_a, **_k) -> dict:
        rss = _peak_rss_bytes()
        return {"active_bytes.all.peak": rss, "reserved_bytes.all.peak": rss,
                "num_alloc_retries": 0, "num_ooms": 0}

    return types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 1,
        set_device=lambda *_a, **_k: None,
        current_device=lambda: 0,
        synchronize=lambda *_a, **_k: None,
        get_device_name=lambda *_a, **_k: "cpu",
        get_device_properties=lambda *_a, **_k: _Props(),
        reset_peak_memory_stats=lambda *_a, **_k: None,
        empty_cache=lambda *_a, **_k: None,
        memory_stats=memory_stats,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )


def apply(name_copies: tuple[str, ...] = _NAME_COPIES) -> None:
    """Point torchtitan at the CPU.  Idempotent; call before building the Trainer.
    ``name_copies``: the modules holding copies (another torchtitan version: its own list)."""
    global _active
    if _active:
        return
    module = _cpu_device_module()
    for name in name_copies:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = module
    _active = True


def fix_fsdp_for_gloo(model: torch.nn.Module) -> None:
    """gloo lacks PREMUL_SUM/AVG for FSDP reductions: force SUM + separate scaling."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def exit_without_teardown(code: int) -> None:
    """End a finished gloo process with ``code`` without interpreter teardown. After the process
    group is destroyed, a gloo thread still joinable at teardown sometimes aborts the process
    ("terminate called without an active exception", SIGABRT) and torchrun fails a run that
    completed (seen in CI, ~1 launch in 100). Flush what is buffered, then leave."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
