"""A deliberately plain DeMo, written independently of flexdemo for the tests to compare.

Per parameter, unpacked: DCT bases from an FFT (not the cosine formula flexdemo uses),
einsum transforms on explicitly zero-padded blocks, int64 indices, two explicit all_gathers
per parameter, and a per-coefficient mean over the replicas' non-zero values written as a
plain loop (a kept coefficient whose value is zero casts no vote). Only 1-D and 2-D tensors,
like the published reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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
            k = min(max(self.topk, 1), coeffs.shape[-1])
            idx = torch.topk(coeffs.abs(), k, dim=-1).indices
            val = torch.gather(coeffs, -1, idx)
            if self.encoding == "bf16":
                val = val.to(torch.bfloat16).to(p.dtype)
            elif self.encoding == "two_bit":
                val = reference_two_levels(val)
            elif self.encoding == "scaled_sign":  # every kept value becomes +-(mean |kept non-zero|) of its block
                voters = (val != 0).sum(-1, keepdim=True).clamp_min(1)
                val = torch.sign(val) * val.abs().sum(-1, keepdim=True) / voters
            own = torch.zeros_like(coeffs).scatter(-1, idx, val)
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
                dense = recompress_mean(torch.cat(all_idx, -1), torch.cat(all_val, -1), dense, self.sharded_topk,
                                        self.encoding)
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
    """The sharded exchange's owners, per block row: keep the ``k2`` coefficients of ``dense``
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
        kept = sorted(range(flat.shape[1]), key=lambda i: (-abs(sums[i]), i))[: min(k2, flat.shape[1])]
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
