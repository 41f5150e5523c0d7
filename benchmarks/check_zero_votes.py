"""On one GPU: zero casts no vote on the fused and the torch path, and the two paths agree on
partial (zero-padded) blocks. Prints one JSON line; exits 1 if a check fails.

1. For every value encoding and both paths, 1000 DeMo steps where one parameter's gradient is
   always exactly zero and another has none: both must stay bitwise unchanged while a trained
   parameter moves.
2. Fused vs torch on shapes whose blocks are partial (a 4096-row matrix as one of 3 FSDP
   shards: 1366 rows; a 3-D tensor; a 1-D tensor), step by step: parameters may differ only
   where the torch path's decoded direction is <= 1e-5 of its largest (rounding decides the
   sign there); the momentum agrees to 1e-5 of its scale (bf16 values: each path rounds its own
   fp32 coefficients, so a coefficient on a rounding boundary may differ by a bf16 ulp; there
   at most 1e-4 of the elements and 2**-7 of the momentum's scale).

    python3 benchmarks/check_zero_votes.py [--steps 1000]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from common import record_decoded_directions
from flexdemo import DeMo

ENCODINGS = ("sign", "scaled_sign", "fp32", "bf16")
RAGGED = [(1366, 2048), (3, 70, 128), (4100,)]


def zero_gradient_run(fused: bool, encoding: str, steps: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    live = torch.randn(512, 512, generator=g, device=device).requires_grad_()
    frozen = torch.randn(1366, 256, generator=g, device=device).requires_grad_()  # zero gradient
    unused = torch.randn(4100, generator=g, device=device).requires_grad_()  # no gradient
    start = [t.detach().clone() for t in (live, frozen, unused)]
    opt = DeMo([live, frozen, unused], lr=1e-3, compression_topk=32, value_encoding=encoding, fused=fused)
    zero = torch.zeros_like(frozen)
    for _ in range(steps):
        live.grad = torch.randn(512, 512, generator=g, device=device)
        frozen.grad = zero
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "fused_kernels": opt.compressor.uses_fused_kernels,
        "live_moved": not torch.equal(live.detach(), start[0]),
        "zero_grad_unchanged": torch.equal(frozen.detach(), start[1]),
        "no_grad_unchanged": torch.equal(unused.detach(), start[2]),
    }


def paths_agree(encoding: str, steps: int, device) -> dict:
    runs = []
    for fused in (True, False):
        g = torch.Generator(device=device).manual_seed(1)
        params = [torch.randn(s, generator=g, device=device).requires_grad_() for s in RAGGED]
        runs.append((params, DeMo(params, lr=1e-3, compression_topk=32, value_encoding=encoding, fused=fused)))
    (fp, fo), (tp, to) = runs
    directions = record_decoded_directions(to)
    worst_differ, worst_momentum = 0, 0.0
    g = torch.Generator(device=device).manual_seed(2)
    for _ in range(steps):
        grads = [torch.randn(s, generator=g, device=device) for s in RAGGED]
        for params, opt in runs:
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()
        for a, b in zip(fp, tp):
            d = directions[b.data_ptr()]
            bad = (a.detach() != b.detach()) & (d.abs() > 1e-5 * d.abs().max())
            worst_differ = max(worst_differ, int(bad.sum()))
            with torch.no_grad():
                a.copy_(b)
        for sa, sb in zip(fo.state.values(), to.state.values()):
            worst_momentum = max(worst_momentum, float((sa["delta"] - sb["delta"]).abs().max()
                                                       / sb["delta"].abs().max()))
    return {"fused_kernels": fo.compressor.uses_fused_kernels, "elements_differing_beyond_noise": worst_differ,
            "momentum_rel_diff": worst_momentum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--agree-steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (torch path only)")
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "zero_gradient": {}, "fused_vs_torch": {}}
    ok = True
    for encoding in ENCODINGS:
        for fused in (True, False):
            r = zero_gradient_run(fused, encoding, args.steps, device)
            out["zero_gradient"][f"{encoding}/{'fused' if fused else 'torch'}"] = r
            ok &= r["fused_kernels"] == fused and r["live_moved"] and r["zero_grad_unchanged"] and r["no_grad_unchanged"]
        r = paths_agree(encoding, args.agree_steps, device)
        out["fused_vs_torch"][encoding] = r
        if encoding == "bf16":
            # Each path rounds its own fp32 coefficients to bf16: one that sits on a rounding
            # boundary may round apart (a bf16 ulp, 2**-8 of it). Replicas never mix paths (the
            # start-up agreement), so this bounds the paths' difference, not the replicas'.
            total = sum(torch.Size(s).numel() for s in RAGGED)
            ok &= (r["fused_kernels"] and r["elements_differing_beyond_noise"] <= 1e-4 * total
                   and r["momentum_rel_diff"] <= 2**-7)
        else:
            ok &= r["fused_kernels"] and r["elements_differing_beyond_noise"] == 0 and r["momentum_rel_diff"] <= 1e-5
    out["ok"] = bool(ok)
    print(json.dumps(out))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
