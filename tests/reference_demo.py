"""A deliberately plain DeMo, written independently of flexdemo for the tests to compare.

Per parameter, unpacked: DCT bases from an FFT (not the cosine formula flexdemo uses),
einsum transforms on explicitly zero-padded blocks, int64 indices, two explicit all_gathers
per parameter, and a per-coefficient mean over the replicas' non-zero values written as a
plain loop (a kept coefficient whose value is zero casts no vote). Only 1-D and 2-D tensors,
like the published reference.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def ref_chunk(dim: int, target: int) -> int:
    """Block edge: the target, or the whole dim when it is shorter (the last block may be partial)."""
    return dim if dim < target else target


def ref_dct_basis(n: int) -> torch.Tensor:
    """``B[i, k]``: orthonormal DCT-II of the unit vector e_i at frequency k, via an FFT."""
    x = torch.eye(n, dtype=torch.float64)
    v = torch.cat([x[:, ::2], x[:, 1::2].flip([1])], dim=1)
    spec = torch.fft.fft(v, dim=1)
    k = torch.arange(n, dtype=torch.float64)
    out = (spec * torch.exp(-1j * torch.pi * k / (2 * n))).real * 2
    out[:, 0] /= (4 * n) ** 0.5
    out[:, 1:] /= (2 * n) ** 0.5
    return out


def reference_block_topks(shape, topk, chunk):
    """Per block: count the tensor's elements in it on a zero-padded mask of ones.

    A 1-D tensor does what bloc97/DeMo's demo.py does with its ``1 x n`` blocks: a whole
    ``chunk``-element chunk keeps ``topk``, clamped to the chunk's coefficients (its
    ``_clamp_topk``); a chunk only partly inside the tensor (the edge of an FSDP shard, which the
    reference never has) keeps that share of ``topk``: ``topk * elements / chunk``, rounded half
    up, at least 1. A tensor of 2 or more dims: k = its share of chunk * chunk times topk, rounded
    half up, at least 1, at most the block's coefficients."""
    x = torch.ones(shape if len(shape) >= 2 else (1, max(1, *shape) if shape else 1))
    x = x.reshape(-1, x.shape[-2], x.shape[-1])
    n1, n2 = min(x.shape[1], chunk), min(x.shape[2], chunk)
    x = F.pad(x, (0, -x.shape[2] % n2, 0, -x.shape[1] % n1))
    blocks = x.reshape(x.shape[0], x.shape[1] // n1, n1, x.shape[2] // n2, n2).transpose(2, 3)
    areas = [int(a) for a in blocks.sum(dim=(-1, -2)).reshape(-1).tolist()]
    if len(shape) <= 1:
        wanted = [topk if a == chunk else math.floor(topk * a / chunk + 0.5) for a in areas]
    else:
        wanted = [math.floor(topk * a / chunk**2 + 0.5) for a in areas]
    return [min(max(k, 1), n1 * n2) for k in wanted]


def reference_payload_nbytes(shapes, topk, chunk, encoding):
    """The wire format written out independently, for tensors of ``shapes`` in one param group:
    tensors whose blocks share a shape and k form one stream (a tensor whose blocks keep
    different k, its own kind of bucket with one sub-stream per k, each byte-aligned) of
    ceil(count * index bits / 8) index bytes, then the values (1- and 2-bit ones: then a
    bits_for(k + 1) voter count per block); one flag byte ends the payload."""
    uniform, ragged = {}, {}
    for shape in shapes:
        if math.prod(shape) == 0:
            continue
        dims = (1, shape[0]) if len(shape) == 1 else (1, 1) if not shape else (math.prod(shape[:-1]), shape[-1])
        n1 = ref_chunk(shape[-2], chunk) if len(shape) > 1 else 1
        n2 = ref_chunk(dims[-1], chunk)
        ks = reference_block_topks(tuple(shape), topk, chunk)
        if len(set(ks)) == 1:
            uniform[(n1, n2, ks[0])] = uniform.get((n1, n2, ks[0]), 0) + len(ks)
        else:
            ragged.setdefault((n1, n2, max(ks)), []).extend(ks)
    streams = [(n1 * n2, k, b) for (n1, n2, k), b in uniform.items()]
    for (n1, n2, _), ks in ragged.items():
        streams += [(n1 * n2, k, ks.count(k)) for k in sorted(set(ks), reverse=True)]
    total = 0
    for numel, k, b in streams:
        count = b * k
        idx_bits = math.ceil(math.log2(numel)) if numel > 1 else 0
        votes = math.ceil(count / 8) + math.ceil(b * math.ceil(math.log2(k + 1)) / 8)  # 0..k voters per block
        # two_bit: a size bit per value after the sign bits, two fp32 levels per block
        value_bytes = {"fp32": 4 * count, "bf16": 2 * count, "sign": votes, "scaled_sign": votes + 4 * b,
                       "two_bit": votes + math.ceil(count / 8) + 8 * b}[encoding]
        total += math.ceil(count * idx_bits / 8) + value_bytes
    return total + 1


def sharded_block_topks(ks, sharded_topk, topk, numel):
    """The owners' means kept per block: the block's top-k times sharded_topk / topk, rounded half
    up, at least 1 (0: the block's top-k)."""
    if not sharded_topk:
        return ks
    return [min(max(math.floor(k * sharded_topk / topk + 0.5), 1), numel) for k in ks]


def ragged_topk(coeffs, ks):
    """Per block row its own ``ks[row]`` largest |coefficients|, as ``[rows, max k]`` indices and
    values, a row's unused slots index 0 with value 0 (no vote)."""
    kmax, flat = max(ks), coeffs.reshape(-1, coeffs.shape[-1])  # blocks in order, whatever the leading dims
    idx = torch.zeros(flat.shape[0], kmax, dtype=torch.long)
    val = torch.zeros(flat.shape[0], kmax, dtype=coeffs.dtype)
    for row, k in enumerate(ks):
        top = torch.topk(flat[row].abs(), k).indices
        idx[row, :k], val[row, :k] = top, flat[row, top]
    return idx.reshape(*coeffs.shape[:-1], kmax), val.reshape(*coeffs.shape[:-1], kmax)


def scatter_rows(shape_like, idx, val):
    """Dense coefficients with each row's non-zero kept values at their indices (a loop)."""
    out = torch.zeros_like(shape_like).reshape(-1, shape_like.shape[-1])
    idx, val = idx.reshape(out.shape[0], -1), val.reshape(out.shape[0], -1)
    for row in range(idx.shape[0]):
        for i, v in zip(idx[row].tolist(), val[row].tolist()):
            if v != 0:
                out[row, i] = v
    return out.reshape(shape_like.shape)


class ReferenceDeMo:
    def __init__(self, params, lr, decay, topk, chunk, weight_decay, encoding, group=None, sharded_topk=None):
        # sharded_topk: the sharded exchange's re-compression of the mean (None: all_gather).
        self.sharded_topk = sharded_topk
        self.params, self.lr, self.decay = list(params), lr, decay
        self.topk, self.chunk, self.wd, self.encoding, self.group = topk, chunk, weight_decay, encoding, group
        self.delta = [torch.zeros_like(p) for p in self.params]

    def _bases(self, p):
        ns = [ref_chunk(s, self.chunk) for s in p.shape]
        fwd = [ref_dct_basis(n).to(p.dtype) for n in ns]
        inv = [torch.linalg.inv(ref_dct_basis(n)).to(p.dtype) for n in ns]
        return ns, fwd, inv

    @staticmethod
    def _pad(x, ns):
        # Zero-pad every dim up to a whole number of blocks (the last block of a dim may be partial).
        padded = x.new_zeros([-(-s // n) * n for s, n in zip(x.shape, ns)])
        padded[tuple(slice(0, s) for s in x.shape)] = x
        return padded

    def _encode(self, x, ns, fwd):
        x = self._pad(x, ns)
        if x.dim() == 1:
            return torch.einsum("xw,wd->xd", x.reshape(-1, ns[0]), fwd[0])
        y = x.reshape(x.shape[0] // ns[0], ns[0], x.shape[1] // ns[1], ns[1])
        return torch.einsum("yhxw,hb,wd->yxbd", y, fwd[0], fwd[1]).flatten(-2)

    def _decode(self, c, shape, ns, inv):
        padded = [-(-s // n) * n for s, n in zip(shape, ns)]
        if len(shape) == 1:
            y = torch.einsum("xd,dw->xw", c, inv[0]).reshape(padded)
        else:
            c = c.reshape(*c.shape[:-1], ns[0], ns[1])
            y = torch.einsum("yxbd,bh,dw->yhxw", c, inv[0], inv[1]).reshape(padded)
        return y[tuple(slice(0, s) for s in shape)]

    @torch.no_grad()
    def step(self, apply: bool = True):
        """One DeMo step; ``apply=False`` leaves the parameters to the caller (``last_decoded``)."""
        world = dist.get_world_size(self.group)
        self.last_decoded = []
        self.last_own_decoded = []  # this replica's payload decoded alone (overlap's look-ahead)
        for p, delta in zip(self.params, self.delta):
            if self.wd:
                p.mul_(1.0 - self.lr * self.wd)
            delta.mul_(self.decay).add_(p.grad, alpha=self.lr)
            ns, fwd, inv = self._bases(p)
            coeffs = self._encode(delta, ns, fwd)
            ks = reference_block_topks(tuple(p.shape), self.topk, self.chunk)
            idx, val = ragged_topk(coeffs, ks)
            if self.encoding == "bf16":
                val = val.to(torch.bfloat16).to(p.dtype)
            elif self.encoding == "two_bit":
                val = reference_two_levels(val)
            elif self.encoding == "scaled_sign":  # every kept value becomes +-(mean |kept non-zero|) of its block
                voters = (val != 0).sum(-1, keepdim=True).clamp_min(1)
                val = torch.sign(val) * val.abs().sum(-1, keepdim=True) / voters
            own = scatter_rows(coeffs, idx, val)
            delta.sub_(self._decode(own, p.shape, ns, inv))
            if self.encoding == "sign":
                val = torch.sign(val)
            own_votes = mean_of_votes(idx, val, coeffs.shape[-1]).reshape(coeffs.shape)
            self.last_own_decoded.append(self._decode(own_votes, p.shape, ns, inv))
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            all_val = [torch.empty_like(val) for _ in range(world)]
            dist.all_gather(all_idx, idx, group=self.group)
            dist.all_gather(all_val, val, group=self.group)
            dense = mean_of_votes(torch.cat(all_idx, -1), torch.cat(all_val, -1), coeffs.shape[-1]).reshape(coeffs.shape)
            if self.sharded_topk is not None:
                k2 = sharded_block_topks(ks, self.sharded_topk, self.topk, coeffs.shape[-1])
                dense = recompress_mean(torch.cat(all_idx, -1), torch.cat(all_val, -1), dense, k2, self.encoding)
                # What the owners did not apply goes back to the momentum it was taken from.
                delta.add_(self._decode(torch.where(dense != 0, 0.0, own), p.shape, ns, inv))
            decoded = self._decode(dense, p.shape, ns, inv)
            self.last_decoded.append(decoded)
            if apply:
                p.sub_(self.lr * decoded.sign())


def reference_two_levels(val):
    """Per block row, written as a loop: its non-zero values split at their mean magnitude; each
    becomes (its sign) x (the mean magnitude of its side); zeros stay zero."""
    flat = val.reshape(-1, val.shape[-1])
    out = torch.zeros_like(flat)
    for row in range(flat.shape[0]):
        mags = [abs(v) for v in flat[row].tolist() if v != 0]
        if not mags:
            continue
        mean = sum(mags) / len(mags)
        high = [m for m in mags if m >= mean]
        low = [m for m in mags if m < mean]
        levels = (sum(low) / len(low) if low else 0.0, sum(high) / len(high))
        for j, v in enumerate(flat[row].tolist()):
            if v != 0:
                out[row, j] = (1.0 if v > 0 else -1.0) * levels[abs(v) >= mean]
    return out.reshape(val.shape)


def mean_of_votes(idx, val, n):
    """Per block row, each coefficient's mean over the values that vote for it: a zero value
    (a kept coefficient that was zero) is no vote; a coefficient without votes is zero."""
    idx, val = idx.reshape(-1, idx.shape[-1]), val.reshape(-1, val.shape[-1])
    out = torch.zeros(idx.shape[0], n, dtype=val.dtype)
    for row in range(idx.shape[0]):
        votes: dict[int, list[float]] = {}
        for i, v in zip(idx[row].tolist(), val[row].tolist()):
            if v != 0:
                votes.setdefault(i, []).append(v)
        for i, vs in votes.items():
            out[row, i] = sum(vs) / len(vs)
    return out


def recompress_mean(idx, val, dense, k2, encoding):
    """The sharded exchange's owners, per block row: keep the ``k2`` (one per row, or one for all)
    coefficients of ``dense``
    (the voters' mean) with the largest |sum of the values voting for them| (ties: the lower
    index), their means sent exactly (fp32) or rounded to bf16 (every other encoding); the rest
    zero."""
    idx, val = idx.reshape(-1, idx.shape[-1]), val.reshape(-1, val.shape[-1])
    flat = dense.reshape(-1, dense.shape[-1])
    out = torch.zeros_like(flat)
    for row in range(flat.shape[0]):
        sums = [0.0] * flat.shape[1]
        for i, v in zip(idx[row].tolist(), val[row].tolist()):
            sums[i] += v
        k_row = k2[row] if isinstance(k2, (list, tuple)) else k2
        kept = sorted(range(flat.shape[1]), key=lambda i: (-abs(sums[i]), i))[: min(k_row, flat.shape[1])]
        means = flat[row, kept]
        if encoding != "fp32":
            means = means.to(torch.bfloat16).to(flat.dtype)
        out[row, kept] = means
    return out.reshape(dense.shape)


def differs_only_where_update_is_zero(ours, ref, decoded) -> bool:
    """Where ours and the reference's parameters differ, was the reference's decoded update ~0?

    The decoded aggregate is often exactly zero in exact arithmetic (opposite votes,
    symmetric cosines); each implementation then takes the sign of its own rounding noise.
    Those elements, and only those, may differ.
    """
    for a, b, dec in zip(ours, ref, decoded):
        differs = a != b
        if differs.any() and dec[differs].abs().max() > 1e-5 * dec.abs().max():
            return False
    return True


def agrees_then_realign(ours, ref, decoded) -> bool:
    """:func:`differs_only_where_update_is_zero`, then ``ref`` takes ``ours``' values, so that an
    update that took the other sign where it was ~0 does not compound over the next steps."""
    agrees = differs_only_where_update_is_zero(ours, ref, decoded)
    with torch.no_grad():
        for a, b in zip(ours, ref):
            b.copy_(a)
    return agrees
