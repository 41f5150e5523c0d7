"""On one GPU: DeMo (fused kernels, one replica) skips a step whose gradient holds a NaN the way
tests/test_nonfinite.py checks on CPU, through the CUDA paths (the encode's device flag, the
decode's lr x keep table, the flags' pinned copy): the skipped step applies only weight decay,
the momentum keeps the step's (zero) gradient, and reading the flags at once or only when the
next step needs them ends bitwise the same. Prints one JSON line; exit 1 on a failed check.

    python3 scripts/gpu_check_skip.py
"""

from __future__ import annotations

import json
import sys

import torch

from flexdemo import DeMo
from flexdemo.compression import compressor

LR, WD, DECAY, BAD_STEP, STEPS = 0.01, 0.1, 0.9, 2, 5
SHAPES = [(256, 512), (128, 64), (1024,)]


def run(read_at_once: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.randn(s, device="cuda", generator=gen).requires_grad_() for s in SHAPES]
    opt = DeMo(params, lr=LR, weight_decay=WD, compression_decay=DECAY, compression_topk=8)
    skipped, ok = [], []
    for step in range(STEPS):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        if step == BAD_STEP:
            params[0].grad[3, 7] = float("nan")
        before = [p.detach().clone() for p in params]
        deltas = [opt.state[p]["delta"].clone() if p in opt.state else torch.zeros_like(p) for p in params]
        opt.step()
        if read_at_once:
            skipped.append(opt.last_step_skipped_by)
        if step == BAD_STEP:
            ok.append(all(torch.equal(p, b * (1 - LR * WD)) for p, b in zip(params, before)))
            if read_at_once:  # the momentum took a zero gradient: decay * delta, the sent part put back
                ok.append(max(float((opt.state[p]["delta"] - d * DECAY).abs().max() / (d * DECAY).abs().max())
                              for p, d in zip(params, deltas)) < 1e-5)
    reports = opt.pop_skipped_steps(wait=True)
    return {"skipped": skipped, "reports": reports, "ok": ok,
            "state": [t.clone() for p in params for t in (p.detach(), opt.state[p]["delta"])]}


def main() -> int:
    at_once = run(True)
    compressor.HostFlags.ready = lambda self: False  # as if the copy were always still on its way
    late = run(False)
    same = all(torch.equal(a, b) for a, b in zip(at_once["state"], late["state"]))
    expected = [[0] if s == BAD_STEP else [] for s in range(STEPS)]
    result = {"device": torch.cuda.get_device_name(), "skipped_at_once": at_once["skipped"],
              "late_reports": late["reports"], "checks": at_once["ok"] + late["ok"], "same_end_state": same}
    good = (at_once["skipped"] == expected and late["reports"] == [(STEPS - 1 - BAD_STEP, [0])] and same
            and all(result["checks"]) and len(result["checks"]) == 3)
    result["pass"] = good
    print(json.dumps(result))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
