"""Overlap applies exactly the delayed update: DeMo with ``overlap=True`` against a run without
overlap whose updates are delayed by hand, on the fused sign path (CUDA over NCCL here; the
same function runs in Triton's CPU interpreter in tests/test_fused_overlap.py).

Per step both optimizers see the same gradients (the overlap run's, every replica its own):

* ``overlapped``: DeMo(overlap=True) on the parameters;
* ``now``: DeMo(overlap=False) on scratch tensors reset to zero before each step, so that after
  its step they hold exactly ``-lr_t * sign(decoded_t)``: this step's update, undelayed;
* ``reference``: a copy of the parameters to which the hand adds the previous step's scratch.

After every step the overlapped parameters must equal the reference bit for bit (the lr changes
every step: the delayed update must carry the lr of its own step). No weight decay: overlap
applies it before the delayed update, a run without overlap in the same pass.

Rank 0 prints one JSON line; exit 1 on a mismatch.

    torchrun --nproc_per_node 2 benchmarks/check_overlap.py
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from flexdemo import DeMo

SHAPES = [(256, 512), (128, 64), (96, 130), (1024,)]


def delayed_update_mismatches(device: str, steps: int = 8, shapes=SHAPES, encoding: str = "sign") -> dict:
    """Run both on this rank's ``device``; returns the steps at which the overlapped parameters
    differ from the hand-delayed reference, whether any update came out zero (a vacuous check),
    and whether the fused kernels ran."""
    rank = dist.get_rank()
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, device=device, generator=gen).requires_grad_() for s in shapes]
    reference = [p.detach().clone() for p in params]
    scratch = [torch.zeros_like(p, requires_grad=True) for p in params]
    kw = dict(lr=0.01, compression_decay=0.9, compression_topk=8, value_encoding=encoding, weight_decay=0.0,
              replicate_group=dist.group.WORLD)
    overlapped, now = DeMo(params, overlap=True, **kw), DeMo(scratch, overlap=False, **kw)
    gen.manual_seed(100 + rank)  # different data per replica
    pending, mismatched, moved = None, [], []
    for step in range(steps):
        lr = 0.01 * (1 + 0.25 * step)
        for opt in (overlapped, now):
            for group in opt.param_groups:
                group["lr"] = lr
        with torch.no_grad():
            for p, s in zip(params, scratch):
                p.grad = torch.randn(p.shape, device=device, generator=gen)
                s.grad = p.grad.clone()
                s.zero_()
        overlapped.step()
        now.step()
        with torch.no_grad():
            if pending is not None:  # the previous step's update, applied now
                for r, u in zip(reference, pending):
                    r.add_(u)
            pending = [s.detach().clone() for s in scratch]
        moved.append(all(bool((u != 0).any()) for u in pending))
        if not all(torch.equal(p.detach(), r) for p, r in zip(params, reference)):
            mismatched.append(step)
    return {"mismatched_steps": mismatched, "every_update_moved": all(moved),
            "fused": overlapped.compressor.uses_fused_kernels and now.compressor.uses_fused_kernels}


def main() -> int:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    out = delayed_update_mismatches("cuda", steps=12)
    ok = not out["mismatched_steps"] and out["every_update_moved"] and out["fused"]
    if rank == 0:
        print(json.dumps({"check": "overlap == hand-delayed update", "device": torch.cuda.get_device_name(),
                          **out, "ok": ok}))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
