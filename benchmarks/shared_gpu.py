"""Several replicas on ONE GPU, for loss comparisons where fewer GPUs are lent than replicas
(benchmarks only; never the library's path):

  NPROC=2 python3 benchmarks/shared_gpu.py CONFIG.toml [--section.key value ...]

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so every rank here puts its
model on cuda:0 and joins a **gloo** process group before torchtitan starts (torchtitan's
``init_distributed`` keeps a group that is already up); gloo moves CUDA tensors through host
memory. The rank code is flexdemo's own (flexdemo.titan.entry.run): the same config check,
trainer and exchange; only the transport differs. Losses and byte counters compare with NCCL
runs (up to the summation order); tokens/s do not: the replicas take turns on one GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    from flexdemo.titan.launch import plan

    p = plan(config, overrides)  # NPROC ranks on this node; the config checked for that world size
    if p.ngpu > 1:
        sys.exit(f"shared_gpu: for one visible GPU, found {p.ngpu} (set CUDA_VISIBLE_DEVICES to one)")
    assets = ["--model.hf_assets_path", p.assets] if p.assets else []
    from torch.distributed.run import main as torchrun

    port = os.environ.get("MASTER_PORT", "29500")
    # rank 0's lines only, prefixed "[rank0]:" as scripts/launch.sh has them (benchmarks/titan_logs.py)
    torchrun(["--nproc_per_node", str(p.nproc), "--master_port", port, "--local-ranks-filter", "0",
              "--role", "rank", "--tee", "3", __file__, "--rank",
              "--job.config_file", config, *assets, *overrides])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        launch_main(sys.argv[1:])
