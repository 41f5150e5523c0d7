"""flexdemo.titan.launch's check of a config on torchtitan 0.3.0, once per node before any rank
starts: the process count (as 0.2.2's: NPROC, #GPUs, else the config's replicate x shard degrees)
and the config checked for the final world size, the memory estimate per GPU (as 0.2.2's
flexdemo.titan.memory line; ``[flexdemo] memory_check``); a bad config exits with one line, code 2. The
embedded corpus and tokenizer are resolved (built on first use) by the TOML reader here, so the
ranks find them built."""

from __future__ import annotations

import os
import sys

from flexdemo.section import FlexDemoConfigError

CPU_DEFAULT_NPROC = 4


def nproc(config: str, overrides: list[str], ngpu: int) -> int:
    """The ranks on this node, the config checked for the final world size, the memory estimate per
    GPU printed (``[flexdemo] memory_check`` warns, or refuses: flexdemo.titan.v0_3.memory)."""
    from .entry import CONFIG_ERROR_EXIT, check

    try:
        parsed = check(["--job.config_file", config, *overrides], None)
        p = parsed.parallelism
        shard = p.data_parallel_shard_degree
        count = int(os.environ.get("NPROC") or ngpu or (
            p.data_parallel_replicate_degree * shard if shard > 0 else CPU_DEFAULT_NPROC))
        world = count * int(os.environ.get("NNODES") or 1)
        final = check(["--job.config_file", config, *overrides], world)
        from .memory import check_memory

        check_memory(final, world, lambda line: print(line, file=sys.stderr, flush=True))
    except FlexDemoConfigError as e:
        print(f"flexdemo: {e}", file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT)
    return count
