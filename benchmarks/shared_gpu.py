"""Several replicas on ONE GPU, for loss comparisons where fewer GPUs are lent than replicas
(benchmarks only; never the library's path):

  NPROC=2 python3 benchmarks/shared_gpu.py CONFIG.toml [--section.key value ...]

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so every rank here puts its
model on cuda:0 and joins a **gloo** process group before torchtitan starts (torchtitan's
``init_distributed`` keeps a group that is already up); gloo moves CUDA tensors through host
memory. The rank code is flexdemo's own (flexdemo.titan.entry.run): the same config check,
trainer and exchange; only the transport differs. Losses and byte counters compare with NCCL
runs (up to the summation order); tokens/s do not: the replicas take turns on one GPU. On a GPU, one
rank per replica only (NPROC = the replicate degree): gloo on CUDA has no PREMUL_SUM for FSDP2's
gradient reduce, and a TP 2 run crashed in it (torch 2.11, H200). On a
machine without a GPU the same path runs on CPU, bit for bit the run scripts/launch.sh starts
(tests/test_titan_e2e.py).
"""

from __future__ import annotations

import os
import sys


def rank_main(argv: list[str]) -> None:
    sys.argv = [sys.argv[0], *argv]  # before torchtitan's import: its parse_args binds sys.argv[1:]
    os.environ["LOCAL_RANK"] = "0"  # torchtitan's device is cuda:LOCAL_RANK; there is one
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():  # (on CPU the same path runs, as a test of it)
        torch.cuda.set_device(0)
    dist.init_process_group(backend="gloo")  # env:// from torchrun
    from flexdemo.titan.entry import run

    run(argv)


def launch_main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: NPROC=N python3 benchmarks/shared_gpu.py CONFIG.toml [overrides]")
    config, overrides = argv[0], argv[1:]
    from flexdemo.titan import launch

    p = launch.plan(config, overrides)  # NPROC ranks on this node; the config checked for that world size
    if p.ngpu > 1:
        sys.exit(f"shared_gpu: for one visible GPU, found {p.ngpu} (set CUDA_VISIBLE_DEVICES to one)")
    assets = ["--model.hf_assets_path", p.assets] if p.assets else []
    # on CPU the ranks fork from launch.py's forkserver, as launch.sh's do (imports paid once)
    start = [] if p.ngpu else ["--start-method", "forkserver", "--run-path"]
    if not p.ngpu:
        launch.start_cpu_forkserver()
    from torch.distributed.run import main as torchrun

    env = os.environ.get
    # as scripts/launch.sh: rank LOG_RANK's lines on the console, prefixed "[rank0]:"
    # (benchmarks/titan_logs.py reads them), every rank's in LOG_DIR when set
    torchrun(["--nproc_per_node", str(p.nproc), "--master_port", env("MASTER_PORT", "29500"),
              "--local-ranks-filter", env("LOG_RANK", "0"), "--role", "rank", "--tee", "3",
              *(["--log-dir", env("LOG_DIR")] if env("LOG_DIR") else []), *start, __file__, "--rank",
              "--job.config_file", config, *assets, *overrides])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        launch_main(sys.argv[1:])
