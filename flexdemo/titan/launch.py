"""``python -m flexdemo.titan.launch [torchrun flags] -- CONFIG.toml [--section.key v ...]``: what
scripts/launch.sh runs on each node. One process checks the config once (:func:`plan`: the
process count, the config for the final world size, the memory estimate, the embedded assets),
then starts the ranks through torchrun's own launcher (``torch.distributed.run.main``) in the
same process, with ``--nproc_per_node`` and the rank command added to the given flags.

How the ranks start:
- with GPUs, as torchrun starts them: ``python -m flexdemo.titan.run`` per rank;
- on CPU (no GPU), forked from a forkserver that has already imported torch's compiler and
  distributed packages and HF ``datasets`` (torchrun's ``--start-method forkserver --run-path``).
  The ranks of a CPU job share a few cores, and each paid ~7 s importing them (4 ranks on
  2 cores: ~15 s per launch). The forkserver starts first and imports while this process checks
  the config. torchtitan itself is imported in each rank, not preloaded: its ConfigManager binds
  ``sys.argv`` as ``parse_args``' default when imported, so it must see the rank's arguments.
  The rank code is the same either way; only how its process starts differs.

This module imports no torchtitan at module level: multiprocessing re-imports it as
``__mp_main__`` in every forked rank before the rank's arguments are set.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass

CPU_DEFAULT_NPROC = 4
# Imported once by the CPU forkserver (flexdemo.titan.entry's heavy dependencies, not torchtitan).
CPU_PRELOAD = ["torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.tensor",
               "torch.nn.attention.varlen", "datasets"]


@dataclass
class LaunchPlan:
    ngpu: int  # GPUs visible on this node (0: CPU with gloo)
    nproc: int  # ranks on this node
    assets: str  # flexdemo's embedded assets to pass as --model.hf_assets_path ("": keep the config's)


def plan(config: str, overrides: list[str]) -> LaunchPlan:
    """Checked once per node before any rank starts, so a bad config fails in one process:
    1. the process count: NPROC, else #GPUs, else (CPU) the config's replicate x shard degrees,
       or CPU_DEFAULT_NPROC where the shard degree is -1;
    2. the config validated for the final world size (NNODES x NPROC), the memory estimate per
       GPU printed (``[flexdemo] memory_check`` warns or refuses);
    3. flexdemo's embedded corpus + tokenizer built once where the config needs them (its
       ``hf_assets_path`` holds no tokenizer and it trains on an embedded dataset, or names no
       path), said in one line; a config's own tokenizer is kept.
    A bad config exits here with one line and code 2 (flexdemo.titan.entry).
    On torchtitan 0.3.0: flexdemo.titan.v0_3.launch_plan (flexdemo.titan.version decides)."""
    import torch

    from . import version

    if version.V0_3:
        from .v0_3.launch_plan import nproc

        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return LaunchPlan(ngpu, nproc(config, overrides, ngpu), "")  # its TOML reader resolves the assets
    from .data import embedded_tokenizer_dir
    from .entry import check_config_or_exit

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = int(os.environ.get("NPROC") or ngpu or _cpu_processes(config, overrides))
    world = nproc * int(os.environ.get("NNODES") or 1)
    job_config = check_config_or_exit(["--job.config_file", config, *overrides], world)
    assets, reason = embedded_tokenizer_dir(job_config)
    if reason:
        print(reason, file=sys.stderr, flush=True)
    return LaunchPlan(ngpu, nproc, str(assets or ""))


def _cpu_processes(config: str, overrides: list[str]) -> int:
    from .entry import check_config_or_exit

    # No estimate here: the world size is not known yet (plan's check has it).
    p = check_config_or_exit(["--job.config_file", config, *overrides], None, memory_estimate=False).parallelism
    shard = p.data_parallel_shard_degree
    return p.data_parallel_replicate_degree * shard if shard > 0 else CPU_DEFAULT_NPROC


def _may_have_gpu() -> bool:
    """False where torch cannot find an NVIDIA GPU (no driver device file, or none made visible):
    decided without importing torch."""
    return os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def start_cpu_forkserver() -> None:
    """The forkserver the CPU ranks fork from, importing CPU_PRELOAD now (beside plan())."""
    import multiprocessing
    import multiprocessing.forkserver

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores (torchrun's default too)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as torchrun's `python -u`: rank logs as they happen
    multiprocessing.set_forkserver_preload(CPU_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") + 1 >= len(argv):
        print("usage: python -m flexdemo.titan.launch [torchrun flags] -- CONFIG.toml [overrides]", file=sys.stderr)
        sys.exit(2)
    cut = argv.index("--")
    torchrun_flags, config, overrides = argv[:cut], argv[cut + 1], argv[cut + 2:]

    started = not _may_have_gpu()
    if started:  # before torch is imported here: the server's imports run beside this process's
        start_cpu_forkserver()
    import torch

    cpu = not torch.cuda.is_available()
    if cpu and not started:
        start_cpu_forkserver()
    p = plan(config, overrides)
    from . import version  # the rank entry of the installed torchtitan

    if cpu:
        print(f"launch: no GPU found, running {p.nproc} CPU processes with gloo", file=sys.stderr, flush=True)
        rank = ["--start-method", "forkserver", "--run-path", version.rank_script()]
    else:
        rank = ["-m", version.rank_module()]
    assets = ["--model.hf_assets_path", p.assets] if p.assets else []

    from torch.distributed.run import main as torchrun

    torchrun([*torchrun_flags, "--nproc_per_node", str(p.nproc), *rank,
              "--job.config_file", config, *assets, *overrides])
    exit_after_success(cpu)


def exit_after_success(cpu: bool) -> None:
    """After success on CPU, skip the interpreter's teardown of torch and torchtitan (~1.8 s of
    every launch on 2 cores) as a finished CPU rank does; a failure raises and exits as usual."""
    if cpu:
        from . import cpu_shim

        cpu_shim.exit_without_teardown(0)


def preflight_main(argv: list[str] | None = None) -> LaunchPlan:
    """``python -m flexdemo.titan.preflight CONFIG.toml [overrides]``: :func:`plan` alone, its
    result as shell assignments (FD_NGPU, FD_NPROC, FD_ASSETS), for scripts that launch otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m flexdemo.titan.preflight CONFIG.toml [overrides]", file=sys.stderr)
        sys.exit(2)
    p = plan(argv[0], argv[1:])
    print(f"FD_NGPU={p.ngpu}")
    print(f"FD_NPROC={p.nproc}")
    print(f"FD_ASSETS={shlex.quote(p.assets)}")
    return p


if __name__ == "__main__":
    main()
