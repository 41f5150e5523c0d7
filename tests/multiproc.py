"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Each rank gets its own process, a FileStore rendezvous and a collective timeout, so a broken
test fails with the rank's traceback instead of hanging. The processes are forked from a
forkserver that imported torch, flexdemo and torchtitan once per test session (a spawned
process paid those imports again, seconds per rank and test: most of the suite's CPU time on
two cores). Each fork starts from that server's clean state, not from the test process's, and
takes the test process's environment as it is at the call (variables read at import time,
such as TRITON_INTERPRET, are the session's).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


# Imported once in the forkserver. One thread after these imports (checked), so forking is safe.
PRELOAD = ["torch", "torch.distributed", "flexdemo", "flexdemo.optim", "flexdemo.titan.optimizer"]


def _context():
    # The forkserver starts with this environment: one OpenMP thread, so no thread pool is forked.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _worker(rank, world_size, store_path, fn, args, queue, env):
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order."""
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, queue, dict(os.environ)))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors = {}, []
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank}:\n{payload}")
                    break  # one failure is enough; the others may be stuck in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 30)
                if p.is_alive():
                    p.kill()
        if errors:
            raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
