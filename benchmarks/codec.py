"""Codec benchmark: DeMo encode/decode time and bytes per step for llama3-8B-shaped tensors.

Per tensor of one FSDP shard (rows / --shards) of llama3-8B (dim 4096, ffn 14336, 8 KV heads,
vocab 128256), it times what one replica's DeMo optimizer does each step, through the
compression component DeMo.step runs (``--path torch`` or ``--path fused``, the Triton kernels):

  encode: momentum update + chunked DCT + top-k + error-feedback IDCT + bit packing
  decode: unpacking W replicas' payloads + mean over selecting replicas + IDCT + sign + update

against the memory-bound floor of reading and writing the fp32 momentum once (measured
with an in-place scale), and compares payload bytes with a bf16 ring all-reduce.

  python benchmarks/codec.py --device cpu --layers 1
  python benchmarks/codec.py --device cuda --layers 32 --embeddings --path fused
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
from common import add_tensor_set_args, emit, llama3_8b_shapes, print_profile, shard_shape, timed

from flexdemo.compression import TopkCompressor
from flexdemo.wire.dct import block_layout
from flexdemo.wire.format import INDEX_CODINGS, VALUE_ENCODINGS, payload_nbytes

@torch.no_grad()
def bench(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    full_shapes = llama3_8b_shapes(32, embeddings=True)  # bytes are always for the whole model
    shapes = [shard_shape(s, args.shards) for s in llama3_8b_shapes(args.layers, args.embeddings)]
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    # The optimizer's own compression path (what DeMo.step runs), with a random momentum.
    comp = TopkCompressor([params], [args.chunk], [args.topk], args.encoding, None, fused=args.path == "fused",
                          index_coding=args.index_coding)
    buckets = comp.buckets
    delta_of = {id(p): torch.randn_like(p) for p in params}
    deltas = list(delta_of.values())
    numel = sum(p.numel() for p in params)

    def floor():
        for d in deltas:
            d.mul_(1.0)  # one read + one write of the momentum

    def encode():
        return [comp.encode(b, [delta_of[id(m.param)] for m in b.members], [m.param.grad for m in b.members],
                            scale=1e-3, decay=0.999) for b in buckets]

    # W replicas' payloads (copies of ours: decode cost does not depend on content).
    gathered = torch.cat(encode()).unsqueeze(0).expand(args.replicas, -1).contiguous()

    def decode():
        for b in buckets:
            idx, vals = comp.unpack(b, gathered)
            comp.decode_sign_update(b, idx, vals, [m.param.data for m in b.members], 1e-3)

    if args.profile:
        print_profile([encode, decode], device)

    t_floor = timed(floor, device, args.iters)
    t_enc = timed(encode, device, args.iters)
    t_dec = timed(decode, device, args.iters)

    full_numel = sum(torch.Size(shard_shape(s, args.shards)).numel() for s in full_shapes)
    payload = {
        enc: sum(payload_nbytes(block_layout(shard_shape(s, args.shards), args.chunk), args.topk, enc,
                                args.index_coding)
                 for s in full_shapes)
        for enc in VALUE_ENCODINGS
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
        "index_coding": args.index_coding,
        "path": args.path,
        "fused_buckets": sum(b.fused for b in buckets),
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


def summarize(folder: str) -> None:
    """One line per codec_*.json in ``folder`` (written by benchmarks/gpu.sh codec)."""
    from pathlib import Path
    for f in sorted(Path(folder).glob("codec_*.json")):
        r = json.loads(f.read_text())
        print(f"{f.stem:22s} floor {r['floor_ms']:6.2f} ms  encode {r['encode_ms']:7.2f}  "
              f"decode {r['decode_ms']:7.2f}  (enc+dec)/floor {r['encode_plus_decode_over_floor']:6.1f}  "
              f"fused buckets {r['fused_buckets']}/{r['buckets']}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        return summarize(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tensor_set_args(ap, "cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--path", default="torch", choices=["torch", "fused"], help="optimizer path to time")
    ap.add_argument("--index-coding", default="fixed", choices=list(INDEX_CODINGS))
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls for the DCT (CUDA)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    result = bench(args)
    result["tf32"] = args.tf32
    emit(result, args.json)


if __name__ == "__main__":
    main()
