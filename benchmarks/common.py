"""What the codec benchmarks share: the llama3-8B and -1B tensor sets, timing, CLI and output,
and a recorder of the torch path's decoded directions (fused vs torch comparisons)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from flexdemo.compression.codec import decode_mean
from flexdemo.wire.format import VALUE_ENCODINGS

DIM, FFN, KV, VOCAB = 4096, 14336, 1024, 128256


def llama3_8b_shapes(layers: int, embeddings: bool) -> list[tuple[int, ...]]:
    layer = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (DIM, FFN), (FFN, DIM), (DIM,), (DIM,)]
    shapes = layer * layers + [(DIM,)]
    if embeddings:
        shapes += [(VOCAB, DIM), (VOCAB, DIM)]
    return shapes


# llama3 1B (16 layers, dim 2048, 512-wide K/V, FFN 8192) with an untied 128,256-token vocabulary:
# 1.50 B parameters.
DIM_1B, LAYERS_1B, FFN_1B, KV_1B = 2048, 16, 8192, 512


def llama3_1b_shapes() -> list[tuple[int, ...]]:
    shapes = [(VOCAB, DIM_1B), (VOCAB, DIM_1B), (DIM_1B,)]  # embeddings, output, final norm
    for _ in range(LAYERS_1B):
        shapes += [(DIM_1B, DIM_1B), (KV_1B, DIM_1B), (KV_1B, DIM_1B), (DIM_1B, DIM_1B),  # wq wk wv wo
                   (FFN_1B, DIM_1B), (DIM_1B, FFN_1B), (FFN_1B, DIM_1B), (DIM_1B,), (DIM_1B,)]  # w1 w2 w3, norms
    return shapes


def shard_shape(shape: tuple[int, ...], shards: int) -> tuple[int, ...]:
    """Rank 0's FSDP2 shard: dim 0 split into ceil(rows / shards) rows."""
    return ((shape[0] + shards - 1) // shards,) + tuple(shape[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, iters: int) -> float:
    """Mean seconds per call after one warm-up call (compiles, basis caches, allocator)."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


def print_profile(fns, device: torch.device, file=sys.stdout) -> None:
    """Top kernels of one call of each of ``fns``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for fn in fns:
            fn()
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), file=file)


def add_tensor_set_args(ap: argparse.ArgumentParser, default_device: str) -> None:
    ap.add_argument("--device", default=default_device)
    ap.add_argument("--layers", type=int, default=1, help="transformer layers to time")
    ap.add_argument("--embeddings", action="store_true", help="also time the embedding and output shards")
    ap.add_argument("--shards", type=int, default=8, help="FSDP shards per node (rank 0's shard is timed)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--encoding", default="sign", choices=list(VALUE_ENCODINGS))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one encode+decode")
    ap.add_argument("--json", help="also write the result here")


def emit(result: dict, json_path: str | None) -> None:
    print(json.dumps(result, indent=2))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


def record_decoded_directions(opt) -> dict[int, torch.Tensor]:
    """Wrap a DeMo's decode so that each step leaves, per parameter (keyed by its data_ptr), the
    decoded direction IDCT(mean over the voting replicas) whose sign it applies: where that is
    ~0, rounding decides the sign, so a comparison of two paths must exempt those elements."""
    comp, directions = opt.compressor, {}
    original = comp.decode_sign_update

    def recording(bucket, idx, vals, targets, *args, **kwargs):
        for m, t in zip(bucket.members, targets):
            rows = slice(m.first_block, m.first_block + m.layout.num_blocks)
            directions[t.data_ptr()] = decode_mean(idx[:, rows].long(), vals[:, rows], m.layout)
        return original(bucket, idx, vals, targets, *args, **kwargs)

    comp.decode_sign_update = recording
    return directions
