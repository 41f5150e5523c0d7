"""One optimizer step on one GPU, side by side in one run: flexdemo's DeMo.step against torch's
fused AdamW and one copy of the parameters, for llama3-1B-shaped fp32 parameters with an
untied 128,256-token vocabulary (1.50 B parameters; one replica, so the exchange is local).

  python3 benchmarks/optimizer_step.py --json out.json

Rows: DeMo (fused Triton kernels, sign values) with kernel_precision "ieee", the same with "tf32x3" (the default),
DeMo's torch path, fused AdamW, and ``p.copy_(q)`` over all parameters (the memory floor of
one read + one write). Each is the median of ``--iters`` timed steps after 2 warm-up steps.
``--profile DIR`` also records two more steps of each DeMo row under torch.profiler and writes
its GPU-time table per kernel (DIR/<row>.txt; the top kernels also go into the JSON), to see
which of top-k, DCT, packing and decode the time goes to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common import llama3_1b_shapes
from flexdemo import DeMo


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def kernel_times(step, rows: int = 25) -> tuple[str, list[dict]]:
    """GPU time per kernel over two calls of ``step`` (after the caller's warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    table = averages.table(sort_by="cuda_time_total", row_limit=rows)
    top = sorted(averages, key=lambda e: e.device_time_total, reverse=True)[:10]
    return table, [{"kernel": e.key, "ms_per_step": e.device_time_total / 2e3, "calls_per_step": e.count / 2}
                   for e in top]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="folder for the per-kernel GPU time of each DeMo row")
    args = ap.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.nn.Parameter(0.02 * torch.randn(s, device=device, generator=g)) for s in llama3_1b_shapes()]
    for p in params:
        p.grad = 1e-3 * torch.randn(p.shape, device=device, generator=g)
    numel = sum(p.numel() for p in params)
    rows = {}

    for name, kw in [("demo_fused_sign", dict(fused=True, kernel_precision="ieee")),
                     ("demo_fused_sign_tf32x3", dict(fused=True, kernel_precision="tf32x3")),
                     ("demo_fused_sign_tf32x3_bf16_momentum",
                      dict(fused=True, kernel_precision="tf32x3", momentum_dtype="bfloat16")),
                     ("demo_torch_sign", dict(fused=False))]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        opt = DeMo(params, lr=1e-4, compression_topk=32, value_encoding="sign", **kw)
        compile_start = time.perf_counter()
        opt.step()  # the first step compiles the Triton kernels
        torch.cuda.synchronize()
        first = time.perf_counter() - compile_start
        step_ms = 1e3 * timed(opt.step, args.iters)
        state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.device.type == "cuda")
        rows[name] = {"first_step_s": first, "step_ms": step_ms, "state_bytes_per_param": state / numel,
                      "peak_above_params_gib": (torch.cuda.max_memory_allocated(device) - before) / 2**30,
                      "payload_bytes": opt.payload_bytes_per_step()}
        if args.profile:
            table, rows[name]["top_kernels"] = kernel_times(opt.step)
            Path(args.profile).mkdir(parents=True, exist_ok=True)
            (Path(args.profile) / f"{name}.txt").write_text(table)
        del opt
        torch.cuda.empty_cache()

    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rows["adamw_fused"] = {"step_ms": 1e3 * timed(adamw.step, args.iters), "state_bytes_per_param": 8.0}
    del adamw
    torch.cuda.empty_cache()
    copies = [torch.empty_like(p) for p in params]

    def copy():
        for c, p in zip(copies, params):
            c.copy_(p)

    rows["param_copy"] = {"step_ms": 1e3 * timed(copy, args.iters)}
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "parameters": numel,
              "rows": rows}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
