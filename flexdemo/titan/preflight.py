"""``python -m flexdemo.titan.preflight CONFIG.toml [--section.key v ...]``

Run once per node by scripts/launch.sh before torchrun, so a bad config fails in one
process with one message instead of in every rank:
  1. pick the process count (NPROC env, else #GPUs, else the config's replicate x shard
     degrees on CPU, or 4 CPU processes where the shard degree is -1),
  2. validate the config for the final world size (NNODES x NPROC),
  3. where the config's ``[model] hf_assets_path`` holds no tokenizer and it asks for an
     embedded dataset (or names no path), build flexdemo's assets once (under $FLEXDEMO_CACHE,
     default ~/.cache/flexdemo) and say so in one line; a config's own tokenizer is kept.
Prints ``FD_NGPU=..``, ``FD_NPROC=..``, ``FD_ASSETS=..`` (empty: keep the config's) for the shell.
"""

import os
import shlex
import sys

CPU_DEFAULT_NPROC = 4


def cpu_processes(config: str, overrides: list[str]) -> int:
    """On CPU: the config's replicate x shard degrees where both are given (one process per
    replica of an elastic config), else CPU_DEFAULT_NPROC."""
    from .run import check_config_or_exit

    p = check_config_or_exit(["--job.config_file", config, *overrides], None).parallelism
    shard = p.data_parallel_shard_degree
    return p.data_parallel_replicate_degree * shard if shard > 0 else CPU_DEFAULT_NPROC


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m flexdemo.titan.preflight CONFIG.toml [overrides]", file=sys.stderr)
        sys.exit(2)
    config, overrides = argv[0], argv[1:]

    import torch

    from .run import check_config_or_exit

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = int(os.environ.get("NPROC") or ngpu or cpu_processes(config, overrides))
    world = nproc * int(os.environ.get("NNODES") or 1)

    job_config = check_config_or_exit(["--job.config_file", config, *overrides], world)

    from .dataloader import embedded_tokenizer_dir

    assets, reason = embedded_tokenizer_dir(job_config)
    if reason:
        print(reason, file=sys.stderr, flush=True)
    assets = assets or ""
    print(f"FD_NGPU={ngpu}")
    print(f"FD_NPROC={nproc}")
    print(f"FD_ASSETS={shlex.quote(str(assets))}")


if __name__ == "__main__":
    main()
