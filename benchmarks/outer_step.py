"""DiLoCo outer step on GPUs: exactness checks, time and memory of one sync, per mode.

Run with one process per GPU (2 replicas x 1 shard):

  torchrun --nproc_per_node 2 benchmarks/outer_step.py --flavor 1B --json out.json
  # the outer top-k's cost as k grows, fused kernels vs torch path, state on the GPU only:
  torchrun --nproc_per_node 2 benchmarks/outer_step.py --topk 32,64,128,256 --configs topk:scaled_sign --no-host-state

Parameters: the shapes of the llama3 flavor (fp32, random, same on every replica), each
replica then moved by its own noise (a stand-in for H inner steps). Per configuration
(dense bf16/fp32, top-k fp32/scaled_sign, state on the GPU or in pinned host memory) it
reports the outer step's wall time, the persistent GPU bytes the outer state adds per
parameter, the peak extra GPU memory during a sync, the bytes over the replica group, and
checks: replicas bit-identical after each sync; host-state results bitwise equal to
GPU-state results; the fused path against the torch path (top-k).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from flexdemo.optim.diloco import DiLoCo
from flexdemo.replica_check import ReplicaMismatchError, check_replicas_identical

CONFIGS = [
    ("dense", "bf16"),
    ("dense", "fp32"),
    ("topk", "fp32"),
    ("topk", "scaled_sign"),
]


def flavor_shapes(flavor: str) -> list[tuple[str, tuple[int, ...]]]:
    from torchtitan.models.llama3 import Transformer

    import flexdemo.titan.register  # noqa: F401  (adds flexdemo's flavors)
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec("flexdemo_llama3").model_args[flavor]
    with torch.device("meta"):
        model = Transformer(args)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def make_params(shapes, device) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator(device=device).manual_seed(0)  # identical on every replica
    return [(n, torch.nn.Parameter(0.02 * torch.randn(s, device=device, generator=g))) for n, s in shapes]


@torch.no_grad()
def drift(params, rank: int, step: int) -> None:
    """Each replica moves its parameters on its own (what H inner steps would do)."""
    g = torch.Generator(device=params[0][1].device).manual_seed(1000 * rank + step)
    for _, p in params:
        p.add_(torch.randn(p.shape, device=p.device, generator=g), alpha=1e-3)


def replicas_identical(params) -> bool:
    try:
        check_replicas_identical(params)
        return True
    except ReplicaMismatchError:
        return False


def run_config(shapes, compression, encoding, state_device, fused, syncs, device, topk=32):
    cuda = device.type == "cuda"  # on CPU (a smoke test with gloo) there are no memory numbers
    mem = torch.cuda if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        mem.empty_cache()
    params = make_params(shapes, device)
    sync()
    base = mem.memory_allocated() if cuda else 0
    outer = DiLoCo(params, sync_interval=1, compression=compression, value_encoding=encoding, topk=topk,
                   chunk=64, decay=0.9, state_device=state_device, fused=fused)
    sync()
    persistent = mem.memory_allocated() - base if cuda else 0
    rank = dist.get_rank()
    times, identical = [], []
    if cuda:
        mem.reset_peak_memory_stats()
    for step in range(syncs):
        outer.before_inner_step()
        drift(params, rank, step)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        outer.after_inner_step()
        sync()
        times.append(time.perf_counter() - t0)
        identical.append(replicas_identical(params))
    peak = mem.max_memory_allocated() - base - persistent if cuda else 0
    numel = sum(p.numel() for _, p in params)
    result = {
        "compression": compression, "encoding": encoding, "state_device": state_device, "fused": fused,
        "topk": topk if compression == "topk" else None,
        "sync_ms_first": 1e3 * times[0], "sync_ms": 1e3 * min(times[1:]) if len(times) > 1 else None,
        "state_gpu_bytes_per_param": persistent / numel, "sync_peak_extra_gpu_bytes_per_param": peak / numel,
        "bytes_sent": outer.last_traffic.sent, "bytes_received": outer.last_traffic.received,
        "replicas_identical_every_sync": all(identical),
    }
    final = [p.detach().clone() for _, p in params]
    del outer, params
    return result, final


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--topk", default="32", help="outer top-k per 64x64 block; a comma list runs each")
    ap.add_argument("--configs", default=",".join(f"{c}:{e}" for c, e in CONFIGS),
                    help="compression:encoding pairs to run (default: all)")
    ap.add_argument("--no-host-state", action="store_true", help="skip the rows with state in pinned host memory")
    args = ap.parse_args()
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {[f'{c}:{e}' for c, e in CONFIGS]}")
    topks = [int(k) for k in args.topk.split(",")]
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shapes = flavor_shapes(args.flavor)
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    rows = []
    for compression, encoding in configs:
        for topk in topks if compression == "topk" else [None]:
            kw = dict(syncs=args.syncs, device=device, topk=topk or 32)
            on_gpu, final_gpu = run_config(shapes, compression, encoding, "device", True, **kw)
            rows.append(on_gpu)
            if not args.no_host_state:
                on_cpu, final_cpu = run_config(shapes, compression, encoding, "cpu", True, **kw)
                on_cpu["bitwise_equal_to_gpu_state"] = all(torch.equal(a, b) for a, b in zip(final_gpu, final_cpu))
                rows.append(on_cpu)
                del final_cpu
            if compression == "topk":
                torch_path, final_torch = run_config(shapes, compression, encoding, "device", False, **kw)
                worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(final_gpu, final_torch))
                torch_path["max_rel_diff_fused_vs_torch"] = worst
                rows.append(torch_path)
                del final_torch
            del final_gpu
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__, "flavor": args.flavor,
              "parameters": numel, "replicas": dist.get_world_size(), "syncs": args.syncs, "rows": rows}
    if rank == 0:
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
