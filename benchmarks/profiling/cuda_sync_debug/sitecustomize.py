"""Diagnostic, not part of the package: put this folder first on PYTHONPATH and every torchrun
worker on a GPU reports each host<->GPU synchronization it makes
(torch.cuda.set_sync_debug_mode("warn")), counted per Python stack (its last frames outside
torch and the standard library): where a training step waits for the GPU. Written at exit to
$CUDA_SYNC_DEBUG_DIR/rank<RANK>.txt (default /tmp/cuda_sync_debug). Used by
benchmarks/README.md (profiling)."""

import atexit
import collections
import os
import sysconfig
import traceback
import warnings


def _install(torch) -> None:
    counts: collections.Counter = collections.Counter()
    shown = warnings.showwarning
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.abspath(__file__))
    own = tuple(d for d in (os.path.dirname(getattr(torch, "__file__", "") or ""), here) if d)
    installed = (paths["purelib"], paths["platlib"])  # may lie inside the stdlib folder

    def app_frame(filename: str) -> bool:
        path = os.path.abspath(filename)
        return not path.startswith(own) and (path.startswith(installed) or not path.startswith(paths["stdlib"]))

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if app_frame(f.filename)]
        counts["\n".join(f"  {os.path.basename(f.filename)}:{f.lineno} {f.name}: {f.line}" for f in frames[-6:])] += 1

    def write():
        out = os.environ.get("CUDA_SYNC_DEBUG_DIR", "/tmp/cuda_sync_debug")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
            for stack, n in counts.most_common():
                f.write(f"{n} syncs from:\n{stack}\n\n")

    warnings.showwarning = record
    warnings.filterwarnings("always", message=".*synchronizing")
    torch.cuda.set_sync_debug_mode("warn")
    atexit.register(write)


if os.environ.get("RANK") is not None:  # a torchrun worker, not torchrun itself
    import torch

    if torch.cuda.is_available():
        _install(torch)
