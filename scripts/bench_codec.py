"""Codec benchmark: DeMo encode/decode time and bytes per step for llama3-8B-shaped tensors.

Per tensor of one FSDP shard (rows / --shards) of llama3-8B (dim 4096, ffn 14336, 8 KV heads,
vocab 128256), it times what one replica's DeMo optimizer does each step, through the
optimizer's own bucket code (``--path torch`` or ``--path fused``, the Triton kernels):

  encode: momentum update + chunked DCT + top-k + error-feedback IDCT + bit packing
  decode: unpacking W replicas' payloads + mean over selecting replicas + IDCT + sign + update

against the memory-bound floor of reading and writing the fp32 momentum once (measured
with an in-place scale), and compares payload bytes with a bf16 ring all-reduce.

  python scripts/bench_codec.py --device cpu --layers 1
  python scripts/bench_codec.py --device cuda --layers 32 --embeddings --path fused
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from flexdemo import DeMo
from flexdemo.codec import payload_nbytes
from flexdemo.dct import block_layout

DIM, FFN, KV, VOCAB = 4096, 14336, 1024, 128256


def llama3_8b_shapes(layers: int, embeddings: bool) -> list[tuple[int, ...]]:
    layer = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (FFN, DIM), (DIM, FFN), (FFN, DIM), (DIM,), (DIM,)]
    shapes = layer * layers + [(DIM,)]
    if embeddings:
        shapes += [(VOCAB, DIM), (VOCAB, DIM)]
    return shapes


def shard_shape(shape: tuple[int, ...], shards: int) -> tuple[int, ...]:
    """Rank 0's FSDP2 shard: dim 0 split into ceil(rows / shards) rows."""
    return ((shape[0] + shards - 1) // shards,) + tuple(shape[1:])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, iters):
    fn()  # warm-up (basis caches, allocator)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


@torch.no_grad()
def bench(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    full_shapes = llama3_8b_shapes(32, embeddings=True)  # bytes are always for the whole model
    shapes = [shard_shape(s, args.shards) for s in llama3_8b_shapes(args.layers, args.embeddings)]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = DeMo(params, lr=1e-3, compression_topk=args.topk, compression_chunk=args.chunk,
               value_encoding=args.encoding, fused=args.path == "fused")
    for p in params:
        opt.state[p]["delta"] = torch.randn_like(p)
    buckets, total = opt._plan()
    deltas = [opt.state[p]["delta"] for p in params]
    numel = sum(p.numel() for p in params)

    def floor():
        for d in deltas:
            d.mul_(1.0)  # one read + one write of the momentum

    def encode():
        return [opt._encode_bucket(b) for b in buckets]

    # W replicas' payloads (copies of ours: decode cost does not depend on content).
    gathered = torch.cat(encode()).unsqueeze(0).expand(args.replicas, -1).contiguous()

    def decode():
        for b in buckets:
            opt._decode_bucket(b, gathered[:, b.byte_offset : b.byte_offset + b.nbytes(args.encoding)])

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            encode()
            decode()
            _sync(device)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25))

    t_floor = _timed(floor, device, args.iters)
    t_enc = _timed(encode, device, args.iters)
    t_dec = _timed(decode, device, args.iters)

    full_numel = sum(torch.Size(shard_shape(s, args.shards)).numel() for s in full_shapes)
    payload = {
        enc: sum(payload_nbytes(block_layout(shard_shape(s, args.shards), args.chunk), args.topk, enc)
                 for s in full_shapes)
        for enc in ("sign", "bf16", "fp32")
    }
    W = args.replicas
    allreduce_bf16 = 2 * (W - 1) / W * 2 * full_numel  # bytes each rank sends in a ring all-reduce
    reference = sum(layout.num_blocks * min(args.topk, layout.block_numel) * 12  # int64 idx + fp32 value
                    for layout in (block_layout(shard_shape(s, args.shards), args.chunk) for s in full_shapes))
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "measured_tensors": len(shapes),
        "measured_elements": numel,
        "shards": args.shards,
        "replicas": W,
        "topk": args.topk,
        "chunk": args.chunk,
        "encoding": args.encoding,
        "path": args.path,
        "fused_buckets": sum(opt._bucket_is_fused(b) for b in buckets),
        "buckets": len(buckets),
        "floor_ms": t_floor * 1e3,
        "encode_ms": t_enc * 1e3,
        "decode_ms": t_dec * 1e3,
        "encode_plus_decode_over_floor": (t_enc + t_dec) / t_floor,
        "model_shard_elements": full_numel,
        "payload_bytes": payload,
        "reference_payload_bytes": reference,
        "allreduce_bf16_bytes_sent": allreduce_bf16,
        "allgather_bytes_sent_ring": (W - 1) * payload[args.encoding],
        "payload_over_allreduce": {k: v / allreduce_bf16 for k, v in payload.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=1, help="transformer layers to time (bytes are for all 32)")
    ap.add_argument("--embeddings", action="store_true", help="also time the embedding and output shards")
    ap.add_argument("--shards", type=int, default=8, help="FSDP shards per node (rank 0's shard is timed)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--encoding", default="sign", choices=["sign", "bf16", "fp32"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--path", default="torch", choices=["torch", "fused"], help="optimizer path to time")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls for the DCT (CUDA)")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one encode+decode")
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    result = bench(args)
    result["tf32"] = args.tf32
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
