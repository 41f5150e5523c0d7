"""Cost of the periodic replica check (``flexdemo.replica_check.check_replicas_identical``, what
``replica_check_interval`` runs) over llama3-1B-shaped fp32 parameters (1.50 B, untied vocabulary)
on one device, to choose the interval's default.

  python3 benchmarks/replica_check.py --device cuda         # the measurement (one GPU)
  python3 benchmarks/replica_check.py --scale 0.01          # CPU smoke (CI-size)

One process in a world of 1 (gloo; NCCL on CUDA): the check's collectives then move nothing. Over
a real replica group they carry one int64 per tensor (147 here: 1.2 kB) and one int64 verdict,
negligible next to hashing 6 GB of parameters. ``--copies 3`` also hashes a DiLoCo global copy
and outer momentum per parameter, as the trainer does in the DiLoCo modes (``--host-copies 2``:
those two in pinned host memory, as with ``outer_state_device = "cpu"``; hashed on the GPU).

Prints one JSON line: the check's median ms over ``--iters`` (after one warm-up), the elements
hashed, GB/s of tensor bytes, and against a step of ``--step-ms`` (default: the 1B step, 8,192
tokens per GPU (seq 2048 x local batch 4, benchmarks/gpu.sh's 1B flags) at 52,500
tokens/s/GPU on 2 x H100, docs/results.md: 156 ms) the share of step time at a few intervals
and the smallest interval whose share is <= 0.5%.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import llama3_1b_shapes, sync  # noqa: E402

from flexdemo.replica_check import check_replicas_identical  # noqa: E402

STEP_MS_1B = 1e3 * 2048 * 4 / 52_500  # tokens per GPU per step / tokens per s per GPU
BUDGET = 0.005  # the check may cost at most this share of the step time
INTERVALS = (10, 50, 100, 200, 300, 500)


def tensors(scale: float, copies: int, host_copies: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Each parameter's ``copies`` tensors; the last ``host_copies`` in (pinned) host memory."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for i, shape in enumerate(llama3_1b_shapes()):
        shape = tuple(max(1, round(d * scale)) for d in shape)
        for c in range(copies):
            t = torch.randn(shape, device=device, generator=g)
            if c >= copies - host_copies:
                t = t.cpu().pin_memory() if device.type == "cuda" else t
            out.append((f"{i}.{c}", t))
    return out


def measure(named, device: torch.device, iters: int) -> list[float]:
    check_replicas_identical(named)  # warm-up: allocator, first collectives
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        check_replicas_identical(named)  # ends with a host read of the verdict: no sync needed
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scale", type=float, default=1.0, help="every dim times this (CPU smoke: 0.01)")
    ap.add_argument("--copies", type=int, default=1, help="tensors per parameter (3: DiLoCo's global copy, momentum)")
    ap.add_argument("--host-copies", type=int, default=0,
                    help="of those, how many in pinned host memory (DiLoCo's outer_state_device = \"cpu\")")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=STEP_MS_1B, help="the training step the check is set against")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)  # NCCL's device
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
        try:
            named = tensors(args.scale, args.copies, args.host_copies, device)
            times = measure(named, device, args.iters)
        finally:
            dist.destroy_process_group()
    # Rounded once, here: the interval and shares below come from the very value reported.
    ms = round(1e3 * statistics.median(times), 3)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tensors": len(named),
        "host_tensors": sum(not t.is_cuda for _, t in named) if device.type == "cuda" else 0,
        "elements": sum(t.numel() for _, t in named),
        "check_ms": ms,
        "check_ms_all": [round(1e3 * t, 3) for t in times],
        "gbytes_per_s": round(nbytes / (ms / 1e3) / 1e9, 2),
        "step_ms": round(args.step_ms, 1),
        "share_of_step_at_interval": {n: round(ms / (n * args.step_ms), 5) for n in INTERVALS},
        "smallest_interval_within_0.5%": math.ceil(ms / (BUDGET * args.step_ms)),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
