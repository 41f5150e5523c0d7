"""DiLoCo outer step on GPUs: exactness checks, time and memory of one sync, per mode.

Run with one process per GPU (2 replicas x 1 shard):

  torchrun --nproc_per_node 2 benchmarks/outer_step.py --flavor 1B --json out.json
  # the outer top-k's cost as k grows, fused kernels vs torch path, state on the GPU only:
  torchrun --nproc_per_node 2 benchmarks/outer_step.py --topk 32,64,128,256 --configs topk:scaled_sign --no-host-state
  # SparseLoCo's outer step (raw values, no DCT: the torch path) against DCT top-k, one GPU:
  torchrun --nproc_per_node 1 benchmarks/outer_step.py --topk 64 --configs topk:two_bit --transform none --no-host-state
  # the outer SGD alone, one GPU: torch.optim.SGD against the hand-written step it replaced, and
  # what stepping host-resident state with torch.optim.SGD would cost against streaming it:
  python3 benchmarks/outer_step.py --sgd-check --json sgd.json

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
    ("topk", "two_bit"),
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


def run_config(shapes, compression, encoding, state_device, fused, syncs, device, topk=32, transform="dct"):
    cuda = device.type == "cuda"  # on CPU (a smoke test with gloo) there are no memory numbers
    mem = torch.cuda if cuda else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        mem.empty_cache()
    params = make_params(shapes, device)
    sync()
    base = mem.memory_allocated() if cuda else 0
    sgd = torch.optim.SGD([p for _, p in params], lr=0.7, momentum=0.9, nesterov=True)
    outer = DiLoCo(params, outer_optimizer=sgd, sync_interval=1, inner_optimizers=(), compression=compression,
                   value_encoding=encoding, topk=topk, chunk=64, decay=0.9, state_device=state_device, fused=fused,
                   transform=transform if compression == "topk" else "dct")
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
        "transform": transform if compression == "topk" else None,
        "fused_kernels": outer.compressor.uses_fused_kernels if outer.compressor is not None else False,
        "sync_ms_first": 1e3 * times[0], "sync_ms": 1e3 * min(times[1:]) if len(times) > 1 else None,
        "state_gpu_bytes_per_param": persistent / numel, "sync_peak_extra_gpu_bytes_per_param": peak / numel,
        "bytes_sent": outer.last_traffic.sent, "bytes_received": outer.last_traffic.received,
        "replicas_identical_every_sync": all(identical),
    }
    final = [p.detach().clone() for _, p in params]
    del outer, params
    return result, final


def _timed(fn, device, repeats=3) -> float:
    """The fastest of ``repeats`` runs of ``fn`` after one warm-up, in ms."""
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = best if i == 0 else min(best, time.perf_counter() - t0)
    return 1e3 * best


@torch.no_grad()
def sgd_check(device, numel: int, steps: int, lr=0.7, mu=0.9) -> dict:
    """DiLoCo's outer step (the given torch.optim.SGD's step() on device state; its functional form
    on streamed host state) against the hand-written step it replaced, on the same random parameters and outer
    gradients, Nesterov momentum, ``steps`` steps; then the time of one step of each placement,
    and of torch.optim.SGD stepping the state where it lives in host memory (grads copied down)."""
    from flexdemo.optim.diloco_outer import OuterStep, new_entry

    shapes = [(2048, 8192)] * max(1, numel // (2048 * 8192))
    g = torch.Generator(device=device).manual_seed(0)
    start = [0.02 * torch.randn(s, device=device, generator=g) for s in shapes]
    grads = [[1e-3 * torch.randn(s, device=device, generator=g) for s in shapes] for _ in range(steps)]
    result = {"parameters": sum(torch.Size(s).numel() for s in shapes), "steps": steps, "lr": lr, "momentum": mu}
    # before: per tensor, m = mu * m + g; p -= lr * (g + mu * m)
    old = [p.clone() for p in start]
    bufs = [torch.zeros_like(p) for p in start]
    for step_grads in grads:
        for p, m, gr in zip(old, bufs, step_grads):
            m.mul_(mu).add_(gr)
            p.add_(gr.add(m, alpha=mu), alpha=-lr)
    finals, outers = {}, {}
    for placement in ("device", "cpu"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        entries = [new_entry(str(i), p, placement == "cpu", True, False) for i, p in enumerate(params)]
        for e, p in zip(entries, params):
            e.global_copy.copy_(p)
        sgd = torch.optim.SGD(params, lr=lr, momentum=mu, nesterov=True)
        outer = OuterStep(sgd, sgd.param_groups[0], entries, placement == "cpu")
        for step_grads in grads:
            outer.step([(e, gr.clone()) for e, gr in zip(entries, step_grads)])  # Nesterov writes into .grad
        finals[placement], outers[placement] = params, (outer, entries)
    for placement, params in finals.items():
        diff = max(float((a - b).abs().max()) for a, b in zip(params, old))
        ulps = max(int((a.view(torch.int32) - b.view(torch.int32)).abs().max()) for a, b in zip(params, old))
        result[f"{placement}_state_max_abs_diff_vs_hand_written"] = diff
        result[f"{placement}_state_max_ulp_diff_vs_hand_written"] = ulps
        result[f"{placement}_state_bitwise_equal_to_hand_written"] = diff == 0.0 and ulps == 0
    result["host_state_bitwise_equal_to_device_state"] = all(
        torch.equal(a, b) for a, b in zip(finals["device"], finals["cpu"]))
    result["max_abs_parameter"] = max(float(p.abs().max()) for p in old)
    for placement, (outer, entries) in outers.items():
        result[f"ms_step_{placement}_state"] = _timed(
            lambda: outer.step([(e, gr.clone()) for e, gr in zip(entries, grads[0])]), device)
    if device.type == "cuda":  # torch.optim.SGD on the pinned host state itself (its CPU kernels)
        host = [torch.zeros(s, pin_memory=True) for s in shapes]
        host_grads = [torch.empty(s, pin_memory=True) for s in shapes]
        opt = torch.optim.SGD(host, lr=lr, momentum=mu, nesterov=True)
        on_device = [p.clone() for p in start]

        def host_step():
            for hg, gr in zip(host_grads, grads[0]):
                hg.copy_(gr, non_blocking=True)
            torch.cuda.synchronize(device)
            for p, hg in zip(host, host_grads):
                p.grad = hg
            opt.step()
            for d, p in zip(on_device, host):
                d.copy_(p, non_blocking=True)

        result["ms_step_torch_sgd_on_host_state"] = _timed(host_step, device)
        result["host_threads"] = torch.get_num_threads()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="1B")
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--topk", default="32", help="outer top-k per 64x64 block; a comma list runs each")
    ap.add_argument("--configs", default=",".join(f"{c}:{e}" for c, e in CONFIGS),
                    help="compression:encoding pairs to run (default: all)")
    ap.add_argument("--no-host-state", action="store_true", help="skip the rows with state in pinned host memory")
    ap.add_argument("--transform", default="dct", choices=["dct", "none"],
                    help="the top-k rows' block transform (none: SparseLoCo's raw values, torch path only)")
    ap.add_argument("--sgd-check", action="store_true", help="the outer SGD alone (one process, no exchange)")
    ap.add_argument("--sgd-numel", type=int, default=1 << 28, help="--sgd-check: parameters (2048x8192 tensors)")
    args = ap.parse_args()
    if args.sgd_check:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, **sgd_check(device, args.sgd_numel, args.syncs)}
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
        return
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
            kw = dict(syncs=args.syncs, device=device, topk=topk or 32, transform=args.transform)
            on_gpu, final_gpu = run_config(shapes, compression, encoding, "device", True, **kw)
            rows.append(on_gpu)
            if not args.no_host_state:
                on_cpu, final_cpu = run_config(shapes, compression, encoding, "cpu", True, **kw)
                on_cpu["bitwise_equal_to_gpu_state"] = all(torch.equal(a, b) for a, b in zip(final_gpu, final_cpu))
                rows.append(on_cpu)
                del final_cpu
            if compression == "topk" and args.transform == "dct":  # with none both rows are the torch path
                torch_path, final_torch = run_config(shapes, compression, encoding, "device", False, **kw)
                worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(final_gpu, final_torch))
                torch_path["max_rel_diff_fused_vs_torch"] = worst
                rows.append(torch_path)
                del final_torch
            del final_gpu
    report = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
              "flavor": args.flavor, "transform": args.transform,
              "parameters": numel, "replicas": dist.get_world_size(), "syncs": args.syncs, "rows": rows}
    if rank == 0:
        print(json.dumps(report, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
