"""Fused (Triton) codec benchmark on the tensors of benchmarks/codec.py.

Per tensor of rank 0's FSDP shard of llama3-8B it times what one replica does each step:

  encode: fused_encode (momentum update + DCT + top-k + error feedback, one launch) + pack_payload
  encode_fused_pack: fused_encode + fused_pack_payload (Triton bit packing, same bytes)
  decode: unpack_payload + mean_of_selected + fused_decode_update (IDCT + sign + param update)
  decode_all_fused: fused_unpack_payload + fused_mean_decode_update (no dense mean either)
  encode_grouped: tensors bucketed by flexdemo.kernels.group_key; per group ONE fused_encode_many +
      ONE fused_pack_payload over the group's concatenated idx/vals
  decode_grouped: per group ONE fused_unpack_payload + ONE fused_mean_decode_update_many

Tensors the fused kernels do not support (1-D norms) take the torch path in every column. The
torch path is timed too (same card, same run), and before timing the first tensor is checked
against the torch path (max differences printed to stderr).

  python3 benchmarks/kernels.py --device cuda --layers 32 --embeddings
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_tensor_set_args, emit, llama3_8b_shapes, print_profile, shard_shape, timed  # noqa: E402,E501

from flexdemo.compression.codec import (  # noqa: E402
    compress as compress_momentum,
    decode_mean,
    mean_of_selected,
    pack_payload,
    select_topk,
    sent_values,
    unpack_payload,
)
from flexdemo.kernels import (  # noqa: E402
    fused_decode_update,
    fused_encode,
    fused_encode_many,
    fused_mean_decode_update,
    fused_mean_decode_update_many,
    fused_pack_payload,
    fused_supported,
    fused_unpack_payload,
    group_block_offsets,
    group_key,
)
from flexdemo.wire.dct import block_layout, blocks_dct, blocks_idct  # noqa: E402

LR, DECAY, PARAM_LR = 1e-3, 0.999, 1e-2


def decode_direction(payloads, layout, k, encoding, dtype):
    """The torch path's decode of one tensor: ``sign(IDCT(mean over selecting replicas))``."""
    idx, vals = unpack_payload(payloads, layout.num_blocks, k, layout.block_numel, encoding, dtype)
    return decode_mean(idx, vals, layout).sign_()


def verify(delta, grad, layout, k, encoding, precision, replicas) -> dict:
    """Fused vs torch on one tensor: index sets, values, updated delta, updated params."""
    d_ref, d_fused = delta.clone(), delta.clone()
    d_ref.mul_(DECAY).add_(grad, alpha=LR)
    coeffs = blocks_dct(d_ref, layout)
    ref_idx, ref_vals = select_topk(coeffs, k)
    sent = torch.zeros_like(coeffs).scatter_(1, ref_idx, sent_values(ref_vals, encoding))
    d_ref.sub_(blocks_idct(sent, layout))
    idx, vals = fused_encode(d_fused, grad, LR, DECAY, layout, k, encoding, precision=precision)

    ref_sorted, order = ref_idx.sort(1)
    same_sets = (idx.long() == ref_sorted).all(1)
    val_diff = (vals - ref_vals.gather(1, order))[same_sets].abs().max().item() if same_sets.any() else float("nan")

    # Decode: W replicas (ours plus shifted copies, so coefficients overlap only partly).
    g_idx = torch.stack([idx.long().roll(w, 0) for w in range(replicas)])
    g_vals = torch.stack([vals.roll(w, 0) * (w + 1) for w in range(replicas)])
    param = torch.randn_like(delta)
    dense = mean_of_selected(g_idx, g_vals, layout.block_numel)
    direction = blocks_idct(dense, layout)
    p_ref = param.add(direction.sign(), alpha=-PARAM_LR)
    p1, p2 = param.clone(), param.clone()
    fused_decode_update(p1, dense, PARAM_LR, layout, precision=precision)
    fused_mean_decode_update(p2, g_idx, g_vals, PARAM_LR, layout, precision=precision)
    near_zero = direction.abs() <= 1e-5 * direction.abs().max()
    payload = pack_payload(idx, vals, layout.block_numel, encoding)
    gathered = torch.stack([payload, payload.flip(0)])  # any bytes: a bit-exact round trip check
    u_ref = unpack_payload(gathered, layout.num_blocks, k, layout.block_numel, encoding, torch.float32)
    u_got = fused_unpack_payload(gathered, layout.num_blocks, k, layout.block_numel, encoding)
    return {
        "pack_bytes_equal": bool(torch.equal(fused_pack_payload(idx, vals, layout.block_numel, encoding), payload)),
        "unpack_equal": bool(torch.equal(u_got[0].long(), u_ref[0]) and torch.equal(u_got[1], u_ref[1])),
        "shape": list(delta.shape),
        "blocks": layout.num_blocks,
        "blocks_with_same_index_set": int(same_sets.sum()),
        "max_abs_val_diff": val_diff,
        "max_abs_val": ref_vals.abs().max().item(),
        "max_abs_delta_diff": (d_fused - d_ref).abs().max().item(),
        "max_abs_delta": d_ref.abs().max().item(),
        "param_mismatches_decode": int((p1 != p_ref).sum()),
        "param_mismatches_mean_decode": int((p2 != p_ref).sum()),
        "param_mismatches_away_from_zero": int(((p1 != p_ref) & ~near_zero).sum() + ((p2 != p_ref) & ~near_zero).sum()),
    }


def _bits_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def verify_grouped(groups, deltas, grads, params, layouts, ks, enc, prec, replicas, per_group=4) -> dict:
    """Grouped vs per-tensor fused kernels on the first `per_group` tensors of every group: bitwise."""
    bad = []
    for key, members in groups.items():
        ids = members[:per_group]
        Ls, k = [layouts[i] for i in ids], ks[ids[0]]
        d_ref = [deltas[i].clone() for i in ids]
        d_grp = [deltas[i].clone() for i in ids]
        ref = [fused_encode(d, grads[i], LR, DECAY, layouts[i], k, enc, precision=prec) for d, i in zip(d_ref, ids)]
        idx, vals = fused_encode_many(d_grp, [grads[i] for i in ids], LR, DECAY, Ls, k, enc, precision=prec)
        offs = group_block_offsets(Ls)
        g_idx = torch.stack([idx.roll(w, 0) for w in range(replicas)])
        g_vals = torch.stack([vals.roll(w, 0) * (w + 1) for w in range(replicas)])
        p_ref = [params[i].clone() for i in ids]
        p_grp = [params[i].clone() for i in ids]
        for j, (p, L) in enumerate(zip(p_ref, Ls)):
            sl = slice(offs[j], offs[j + 1])
            fused_mean_decode_update(p, g_idx[:, sl], g_vals[:, sl], PARAM_LR, L, precision=prec)
        fused_mean_decode_update_many(p_grp, g_idx, g_vals, PARAM_LR, Ls, precision=prec)
        for j, i in enumerate(ids):
            sl = slice(offs[j], offs[j + 1])
            ok = (torch.equal(idx[sl], ref[j][0]) and _bits_equal(vals[sl], ref[j][1])
                  and _bits_equal(d_grp[j], d_ref[j]) and _bits_equal(p_grp[j], p_ref[j]))
            if not ok:
                bad.append([str(key), i])
    return {"groups": len(groups), "tensors_checked": sum(min(len(m), per_group) for m in groups.values()),
            "mismatching": bad, "all_bitwise_equal": not bad}


def bench(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    shapes = [shard_shape(s, args.shards) for s in llama3_8b_shapes(args.layers, args.embeddings)]
    layouts = [block_layout(s, args.chunk) for s in shapes]
    ks = [min(args.topk, L.block_numel) for L in layouts]
    fused = [fused_supported(L, device) for L in layouts]
    deltas = [torch.randn(s, device=device) for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]
    params = [torch.randn(s, device=device) for s in shapes]
    numel = sum(d.numel() for d in deltas)
    enc, prec, W = args.encoding, args.precision, args.replicas

    first = next(i for i, f in enumerate(fused) if f)
    check = verify(deltas[first], grads[first], layouts[first], ks[first], enc, prec, W)
    print(json.dumps({"verify": check}), file=sys.stderr)

    # Groups for the grouped path: fused tensors bucketed by group_key, list order kept.
    groups: dict = {}
    for i, (L, k, f) in enumerate(zip(layouts, ks, fused)):
        if f:
            groups.setdefault(group_key(L, k, enc), []).append(i)
    unfused = [i for i, f in enumerate(fused) if not f]
    check_grouped = verify_grouped(groups, deltas, grads, params, layouts, ks, enc, prec, W)
    print(json.dumps({"verify_grouped": check_grouped}), file=sys.stderr)
    g_layouts = {key: [layouts[i] for i in ids] for key, ids in groups.items()}
    g_deltas = {key: [deltas[i] for i in ids] for key, ids in groups.items()}
    g_grads = {key: [grads[i] for i in ids] for key, ids in groups.items()}
    g_params = {key: [params[i] for i in ids] for key, ids in groups.items()}

    def floor():
        for d in deltas:
            d.mul_(1.0)

    def encode(fused_pack: bool):
        def run():
            out = []
            for d, g, L, k, f in zip(deltas, grads, layouts, ks, fused):
                if f:
                    idx, vals = fused_encode(d, g, LR, DECAY, L, k, enc, precision=prec)
                    pack = fused_pack_payload if fused_pack else pack_payload
                    out.append(pack(idx, vals, L.block_numel, enc))
                else:
                    d.mul_(DECAY).add_(g, alpha=LR)
                    out.append(pack_payload(*compress_momentum(d, L, k, enc), L.block_numel, enc))
            return out
        return run

    def encode_torch():
        for d, g, L, k in zip(deltas, grads, layouts, ks):
            d.mul_(DECAY).add_(g, alpha=LR)
            pack_payload(*compress_momentum(d, L, k, enc), L.block_numel, enc)

    payloads = encode(False)()
    gathered = [p.unsqueeze(0).expand(W, -1).contiguous() for p in payloads]

    def decode(all_fused: bool):
        def run():
            for p, g, L, k, f in zip(params, gathered, layouts, ks, fused):
                if not f:
                    p.add_(decode_direction(g, L, k, enc, torch.float32), alpha=-PARAM_LR)
                elif all_fused:
                    idx, vals = fused_unpack_payload(g, L.num_blocks, k, L.block_numel, enc)
                    fused_mean_decode_update(p, idx, vals, PARAM_LR, L, precision=prec)
                else:
                    idx, vals = unpack_payload(g, L.num_blocks, k, L.block_numel, enc, torch.float32)
                    fused_decode_update(p, mean_of_selected(idx, vals, L.block_numel), PARAM_LR, L, precision=prec)
        return run

    def encode_grouped():
        out = {}
        for key, ids in groups.items():
            (n1, n2, k, _), Ls = key, g_layouts[key]
            idx, vals = fused_encode_many(g_deltas[key], g_grads[key], LR, DECAY, Ls, k, enc, precision=prec)
            out[key] = fused_pack_payload(idx, vals, n1 * n2, enc)
        for i in unfused:
            deltas[i].mul_(DECAY).add_(grads[i], alpha=LR)
            out[i] = pack_payload(*compress_momentum(deltas[i], layouts[i], ks[i], enc), layouts[i].block_numel, enc)
        return out

    g_payloads = encode_grouped()
    g_gathered = {key: p.unsqueeze(0).expand(W, -1).contiguous() for key, p in g_payloads.items()}
    g_blocks = {key: group_block_offsets(Ls)[-1] for key, Ls in g_layouts.items()}

    def decode_grouped():
        for key in groups:
            n1, n2, k, _ = key
            idx, vals = fused_unpack_payload(g_gathered[key], g_blocks[key], k, n1 * n2, enc)
            fused_mean_decode_update_many(g_params[key], idx, vals, PARAM_LR, g_layouts[key], precision=prec)
        for i in unfused:
            params[i].add_(decode_direction(g_gathered[i], layouts[i], ks[i], enc, torch.float32), alpha=-PARAM_LR)

    def decode_torch():
        for p, g, L, k in zip(params, gathered, layouts, ks):
            p.add_(decode_direction(g, L, k, enc, torch.float32), alpha=-PARAM_LR)

    if args.profile:
        print_profile([encode(False), encode(True), decode(False), decode(True), encode_grouped, decode_grouped],
                      device, file=sys.stderr)

    t_floor = timed(floor, device, args.iters)
    t_enc = timed(encode(False), device, args.iters)
    t_enc_fp = timed(encode(True), device, args.iters)
    t_dec = timed(decode(False), device, args.iters)
    t_dec_all = timed(decode(True), device, args.iters)
    t_enc_g = timed(encode_grouped, device, args.iters)
    t_dec_g = timed(decode_grouped, device, args.iters)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "measured_tensors": len(shapes),
        "fused_tensors": sum(fused),
        "measured_elements": numel,
        "fused_elements": sum(d.numel() for d, f in zip(deltas, fused) if f),
        "shards": args.shards,
        "replicas": W,
        "topk": args.topk,
        "chunk": args.chunk,
        "encoding": enc,
        "precision": prec,
        "verify": check,
        "verify_grouped": check_grouped,
        "groups": {f"{k[0]}x{k[1]} k={k[2]} {k[3]}": len(ids) for k, ids in groups.items()},
        "floor_ms": t_floor * 1e3,
        "encode_ms": t_enc * 1e3,
        "encode_fused_pack_ms": t_enc_fp * 1e3,
        "decode_ms": t_dec * 1e3,
        "decode_all_fused_ms": t_dec_all * 1e3,
        "encode_grouped_ms": t_enc_g * 1e3,
        "decode_grouped_ms": t_dec_g * 1e3,
        "encode_plus_decode_over_floor": (t_enc + t_dec) / t_floor,
        "all_fused_encode_plus_decode_over_floor": (t_enc_fp + t_dec_all) / t_floor,
        "grouped_encode_plus_decode_over_floor": (t_enc_g + t_dec_g) / t_floor,
        "kernel_resources": kernel_resources(),
    }
    if not args.no_torch:
        t_enc_t = timed(encode_torch, device, args.iters)
        t_dec_t = timed(decode_torch, device, args.iters)
        result.update({
            "torch_encode_ms": t_enc_t * 1e3,
            "torch_decode_ms": t_dec_t * 1e3,
            "torch_encode_plus_decode_over_floor": (t_enc_t + t_dec_t) / t_floor,
        })
    return result


def kernel_resources() -> dict:
    """Registers, spills and shared memory of every compiled variant of the grouped encode and
    decode kernels (what limits how many blocks an SM runs at once); empty where this Triton
    keeps its compiled kernels elsewhere."""
    from flexdemo.kernels import decode, encode

    out = {}
    for name, fn in (("encode", encode._encode_many_kernel), ("decode", decode._mean_decode_many_kernel)):
        rows = []
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in cache.values():
                meta = getattr(compiled, "metadata", None)
                rows.append({"n_regs": getattr(compiled, "n_regs", None),
                             "n_spills": getattr(compiled, "n_spills", None),
                             "shared": getattr(meta, "shared", None), "num_warps": getattr(meta, "num_warps", None)})
        out[name] = rows
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tensor_set_args(ap, "cuda")
    ap.add_argument("--precision", default="ieee", choices=["ieee", "tf32x3", "tf32"],
                    help="tl.dot input precision in the fused kernels")
    ap.add_argument("--no-torch", action="store_true", help="skip timing the torch path")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch path in fp32, as in bench_codec's default
    emit(bench(args), args.json)

if __name__ == "__main__":
    main()
