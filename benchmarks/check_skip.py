"""On GPUs, two replicas over NCCL (torchrun, one process per GPU): DeMo (fused kernels) skips a
step whose gradient holds a NaN on replica 1 the way tests/test_nonfinite.py checks on CPU, but
through the CUDA paths (the encode's device flag, the decode's lr x keep table, the flag bytes'
pinned copy, with overlap the copy on a side stream as soon as the exchange lands):

- without overlap, flags read at once (last_step_skipped_by) and read only when the next step
  needs them (the copy never reports ready) end bitwise the same;
- with overlap, the early side-stream copy and the copy made when the update is applied end
  bitwise the same;
- the skipped step applies only weight decay, every replica alike, nothing non-finite anywhere.

Rank 0 prints one JSON line; exit 1 on a failed check.

    torchrun --nproc_per_node 2 benchmarks/check_skip.py
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from flexdemo import DeMo
from flexdemo.compression import compressor

LR, WD, DECAY, BAD_STEP, STEPS = 0.01, 0.1, 0.9, 2, 5
SHAPES = [(256, 512), (128, 64), (1024,)]


def run(overlap: bool, read_at_once: bool) -> dict:
    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).requires_grad_() for s in SHAPES]
    opt = DeMo(params, lr=LR, weight_decay=WD, compression_decay=DECAY, compression_topk=8, overlap=overlap,
               replicate_group=dist.group.WORLD)
    gen.manual_seed(100 + rank)  # different data per replica
    skipped, ok = [], []
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        if step == BAD_STEP and rank == 1:
            params[0].grad[3, 7] = float("nan")
        before = [p.detach().clone() for p in params]
        opt.step()
        if read_at_once:
            skipped.append(opt.last_step_skipped_by)
        if step == BAD_STEP + overlap:  # overlap applies (here: skips) an update one step later
            ok.append(all(torch.equal(p, b * (1 - LR * WD)) for p, b in zip(params, before)))
    opt.finish_pending()
    reports = opt.pop_skipped_steps(wait=True)
    state = [t.clone() for p in params for t in (p.detach(), opt.state[p]["delta"])]
    ok.append(all(bool(torch.isfinite(t).all()) for t in state))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [p.detach().cpu() for p in params])
    ok.append(all(torch.equal(a, b) for other in gathered for a, b in zip(gathered[0], other)))
    return {"skipped": skipped, "reports": reports, "ok": ok, "state": state}


def main() -> int:
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    results = {}
    results["at_once"] = run(False, True)
    ready = compressor.HostFlags.ready
    compressor.HostFlags.ready = lambda self: False  # as if the copy were always still on its way
    results["late"] = run(False, False)
    compressor.HostFlags.ready = ready
    results["overlap_early_copy"] = run(True, True)
    start = compressor.TopkCompressor.start_exchange

    def start_without_early_copy(self, *args, **kwargs):
        started = start(self, *args, **kwargs)
        started.flags = None
        return started

    compressor.TopkCompressor.start_exchange = start_without_early_copy
    results["overlap_copy_at_apply"] = run(True, True)
    compressor.TopkCompressor.start_exchange = start
    expected = [[1] if s == BAD_STEP else [] for s in range(STEPS)]
    expected_overlap = [[1] if s == BAD_STEP + 1 else [] for s in range(STEPS)]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(results[a]["state"], results[b]["state"]))

    checks = {
        "skipped_at_once": results["at_once"]["skipped"] == expected,
        "late_reports": results["late"]["reports"] == [(STEPS - 1 - BAD_STEP, [1])],
        "late_same_end_state": same("at_once", "late"),
        "overlap_skipped": results["overlap_early_copy"]["skipped"] == expected_overlap
        and results["overlap_copy_at_apply"]["skipped"] == expected_overlap,
        "overlap_same_end_state": same("overlap_early_copy", "overlap_copy_at_apply"),
        "per_run_checks": all(all(r["ok"]) for r in results.values()),
    }
    good = all(checks.values())
    if dist.get_rank() == 0:
        print(json.dumps({"device": torch.cuda.get_device_name(), "world": dist.get_world_size(), **checks,
                          "pass": good}))
    dist.destroy_process_group()
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
