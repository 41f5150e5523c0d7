"""On 2 GPUs (NCCL): replicas that would decode differently refuse to start, with one line
naming the setting and both values; replicas that agree train and stay bit-identical.

Each case starts 2 processes (torch.multiprocessing, NCCL, one GPU each) that build DeMo over
the same llama-like shapes, one setting different on rank 1; every rank must raise
ReplicaSettingsMismatch naming it, before any exchange. Prints one line per case and exits 1
if a case does not behave.

    python3 benchmarks/check_agreement.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1024, 512), (1366, 256), (512,)]
CASES = {
    "agree": ({}, None),
    "decode path": ({"fused": False}, "decode path"),
    "kernel precision": ({"kernel_precision": "ieee"}, "kernel precision"),
    "top-k": ({"compression_topk": 16}, "parameter 0"),
}


def _rank(rank: int, world: int, port: int, case: str, results) -> None:
    from flexdemo import DeMo
    from flexdemo.compression.agreement import ReplicaSettingsMismatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=g, device=device).requires_grad_() for s in SHAPES]
    kwargs = dict(lr=1e-3, compression_topk=32, fused=True, kernel_precision="tf32x3")
    if rank == 1:
        kwargs.update(CASES[case][0])
    try:
        opt = DeMo(params, **kwargs)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=torch.Generator(device=device).manual_seed(step + rank),
                                     device=device)
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        out = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(out, flat)
        results[rank] = ("trained", all(torch.equal(o, out[0]) for o in out), opt.compressor.uses_fused_kernels)
    except ReplicaSettingsMismatch as e:
        results[rank] = ("refused", e.setting, str(e))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ok = True
    for i, (case, (_, expected)) in enumerate(CASES.items()):
        results = mp.Manager().dict()
        mp.spawn(_rank, args=(2, 29700 + i, case, results), nprocs=2, join=True)
        got = [results.get(r) for r in range(2)]
        if expected is None:
            good = all(r is not None and r[0] == "trained" and r[1] and r[2] for r in got)
        else:
            good = all(r is not None and r[0] == "refused" and r[1] == expected for r in got)
        ok &= good
        print(f"{case}: {'ok' if good else 'FAILED'}: " + " | ".join(str(r[-1] if r else None) for r in got))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
