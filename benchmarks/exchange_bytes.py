"""Bytes per rank per step of the replica exchange against the number of replicas W.

Measured: W gloo ranks on this CPU (1 shard each) run one exchange of a small model's
compressed momentum with each exchange, counting the bytes of every collective's buffers that
cross between ranks. Modelled: the same per-rank formula for llama3-1B shapes (1.50 B
parameters, one shard per replica) up to W = 1024, next to a bf16 ring all-reduce of the
gradients (2 (W-1)/W x 2 bytes x parameters per rank).

  python3 benchmarks/exchange_bytes.py --measure 2,3,4,5,8,16 --model 2,4,8,16,64,256,1024

With --topks: per top-k, the 1B payload per step with fixed-width and Elias-Fano indices (bits
per kept coefficient, and how many times fewer bytes than a bf16 ring all-reduce at W = 2).

  python3 benchmarks/exchange_bytes.py --topks 4,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # multiproc: spawned gloo ranks
from common import llama3_1b_shapes  # noqa: E402

from flexdemo.compression import TopkCompressor  # noqa: E402
from flexdemo.compression.buckets import build_plan  # noqa: E402
from flexdemo.compression.sharded import ShardedExchange  # noqa: E402

SMALL_SHAPES = [(2048, 512), (1000, 300), (8192,), (7, 11)]
EXCHANGES = ("allgather", "sharded")


def count_collectives():
    """Wrap the two collectives the exchanges use so that every byte leaving or reaching this
    rank is counted from the buffers themselves (not from the library's own accounting)."""
    import torch.distributed as dist

    counted = {"sent": 0, "received": 0}
    a2a, gather = dist.all_to_all_single, dist.all_gather_into_tensor

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        me, world = dist.get_rank(group), dist.get_world_size(group)
        outs = output_split_sizes or [output.numel() // world] * world
        ins = input_split_sizes or [input.numel() // world] * world
        counted["received"] += (sum(outs) - outs[me]) * output.element_size()
        counted["sent"] += (sum(ins) - ins[me]) * input.element_size()
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    def all_gather_into_tensor(output, input, group=None, **kw):
        world = dist.get_world_size(group)
        counted["received"] += (world - 1) * input.numel() * input.element_size()
        counted["sent"] += input.numel() * input.element_size()  # leaves once (ring: forwarded on)
        return gather(output, input, group=group, **kw)

    dist.all_to_all_single, dist.all_gather_into_tensor = all_to_all_single, all_gather_into_tensor
    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single = all_gather_into_tensor
    import flexdemo.replica_group as replica_group

    replica_group.all_gather_flat = all_gather_into_tensor
    return counted


def _one_exchange(rank: int, world: int, topk: int, encoding: str, index_coding: str = "fixed") -> dict:
    counted = count_collectives()
    params = [torch.zeros(s) for s in SMALL_SHAPES]
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for exchange in EXCHANGES:
        comp = TopkCompressor([params], [64], [topk], encoding, None, exchange=exchange, index_coding=index_coding)
        payloads = [comp.encode(b, [torch.randn(m.param.shape, generator=gen) for m in b.members])
                    for b in comp.buckets]
        counted["sent"] = counted["received"] = 0
        comp.exchange(payloads)
        out[exchange] = {"sent": counted["sent"], "received": counted["received"],
                         "reported": [comp.last_traffic.sent, comp.last_traffic.received], "payload": comp.nbytes}
    return out


def measure(worlds: list[int], topk: int, encoding: str, index_coding: str = "fixed") -> list[dict]:
    from multiproc import run_ranks

    rows = []
    for world in worlds:
        ranks = run_ranks(_one_exchange, world, topk, encoding, index_coding, timeout=600)
        row = {"W": world, "payload_bytes": ranks[0]["allgather"]["payload"]}
        for exchange in EXCHANGES:
            row[exchange] = max(r[exchange]["received"] for r in ranks)
            row[f"{exchange}_sent"] = max(r[exchange]["sent"] for r in ranks)
            row[f"{exchange}_reported_matches"] = all(
                r[exchange]["reported"] == [r[exchange]["sent"], r[exchange]["received"]] for r in ranks)
        rows.append(row)
    return rows


def model(worlds: list[int], topk: int, encoding: str, sharded_topk: int, index_coding: str = "fixed") -> list[dict]:
    shapes = llama3_1b_shapes()
    params = sum(torch.Size(s).numel() for s in shapes)
    entries = [[(None, s, torch.float32) for s in shapes]]
    rows = []
    for world in worlds:
        buckets, payload = build_plan(entries, [64], [topk], encoding, index_coding)
        sharded = ShardedExchange(buckets, encoding, sharded_topk, world, rank=0).traffic()
        rows.append({"W": world, "allgather": (world - 1) * (payload + 1), "sharded": sharded.received,
                     "bf16_ring_allreduce": round(2 * (world - 1) / world * 2 * params)})
    return rows


def markdown(rows: list[dict]) -> str:
    ring = "bf16_ring_allreduce" in rows[0]
    head = "| W | all_gather | sharded | sharded / its W=2 |" + (
        " bf16 ring all-reduce | ring / all_gather | ring / sharded |" if ring else "")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    base = rows[0]["sharded"]
    for r in rows:
        line = f"| {r['W']} | {r['allgather']:,} | {r['sharded']:,} | {r['sharded'] / base:.2f} |"
        if ring:
            b = r["bf16_ring_allreduce"]
            line += f" {b:,} | {b / r['allgather']:,.1f}x | {b / r['sharded']:,.0f}x |"
        lines.append(line)
    return "\n".join(lines)


def index_table(topks: list[int], encoding: str) -> list[dict]:
    """Per top-k, the llama3-1B payload per step (1 shard) with each index coding."""
    shapes = llama3_1b_shapes()
    params = sum(torch.Size(s).numel() for s in shapes)
    entries = [[(None, s, torch.float32) for s in shapes]]
    rows = []
    for k in topks:
        row = {"topk": k}
        for coding in ("fixed", "elias_fano"):
            buckets, payload = build_plan(entries, [64], [k], encoding, coding)
            kept = sum(sum(b.per_block.per_block) if b.ragged else b.num_blocks * b.k for b in buckets)
            row[coding] = {"payload_bytes": payload + 1, "bits_per_kept": 8 * payload / kept,
                           "x_fewer_than_bf16_ring_w2": 2 * params / (payload + 1)}
        rows.append(row)
    return rows


def index_markdown(rows: list[dict]) -> str:
    lines = ["| top-k | fixed: bytes/step | bits/kept | x fewer than bf16 ring | elias_fano: bytes/step | bits/kept "
             "| x fewer than bf16 ring | saved |", "|" + "---:|" * 8]
    for r in rows:
        f, e = r["fixed"], r["elias_fano"]
        lines.append(f"| {r['topk']} | {f['payload_bytes']:,} | {f['bits_per_kept']:.2f} | "
                     f"{f['x_fewer_than_bf16_ring_w2']:,.0f}x | {e['payload_bytes']:,} | {e['bits_per_kept']:.2f} | "
                     f"{e['x_fewer_than_bf16_ring_w2']:,.0f}x | {1 - e['payload_bytes'] / f['payload_bytes']:.1%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measure", default="2,3,4,5,8,16", help="replica counts run on this CPU (gloo)")
    ap.add_argument("--model", default="2,4,8,16,64,256,1024", help="replica counts of the 1B formula")
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--sharded-topk", type=int, default=0, help="0: the top-k")
    ap.add_argument("--encoding", default="sign")
    ap.add_argument("--index-coding", default="fixed", choices=("fixed", "elias_fano"))
    ap.add_argument("--topks", default="", help="instead: the 1B payload per top-k, fixed vs Elias-Fano indices")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.topks:
        rows = index_table([int(k) for k in args.topks.split(",")], args.encoding)
        print(f"llama3-1B payload per step, 1 shard, {args.encoding} values:")
        print(index_markdown(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    measured = measure([int(w) for w in args.measure.split(",") if w], args.topk, args.encoding, args.index_coding)
    modelled = model([int(w) for w in args.model.split(",") if w], args.topk, args.encoding, args.sharded_topk,
                     args.index_coding)
    print("measured (CPU, gloo; bytes received per rank per exchange, most-loaded rank):")
    print(markdown(measured))
    print("\nmodelled (llama3-1B shapes, 1 shard per replica):")
    print(markdown(modelled))
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": measured, "modelled": modelled}, indent=1))
    return 0 if all(r[f"{e}_reported_matches"] for r in measured for e in EXCHANGES) else 1


if __name__ == "__main__":
    sys.exit(main())
