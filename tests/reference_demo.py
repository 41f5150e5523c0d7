"""A deliberately plain DeMo, written independently of flexdemo for the tests to compare.

Per parameter, unpacked: DCT bases from an FFT (not the cosine formula flexdemo uses),
einsum transforms, int64 indices, two explicit all_gathers per parameter, and
``scatter_reduce(mean)`` decoding, as in the published reference. Only 1-D and 2-D
tensors, like the reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def ref_chunk(dim: int, target: int) -> int:
    divisors = [d for d in range(1, dim + 1) if dim % d == 0]
    smaller = [d for d in divisors if d <= target]
    return dim if dim < target else max(smaller)


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
    def __init__(self, params, lr, decay, topk, chunk, weight_decay, encoding, group=None):
        self.params, self.lr, self.decay = list(params), lr, decay
        self.topk, self.chunk, self.wd, self.encoding, self.group = topk, chunk, weight_decay, encoding, group
        self.delta = [torch.zeros_like(p) for p in self.params]

    def _bases(self, p):
        ns = [ref_chunk(s, self.chunk) for s in p.shape]
        fwd = [ref_dct_basis(n).to(p.dtype) for n in ns]
        inv = [torch.linalg.inv(ref_dct_basis(n)).to(p.dtype) for n in ns]
        return ns, fwd, inv

    def _encode(self, x, ns, fwd):
        if x.dim() == 1:
            return torch.einsum("xw,wd->xd", x.reshape(-1, ns[0]), fwd[0])
        y = x.reshape(x.shape[0] // ns[0], ns[0], x.shape[1] // ns[1], ns[1])
        return torch.einsum("yhxw,hb,wd->yxbd", y, fwd[0], fwd[1]).flatten(-2)

    def _decode(self, c, shape, ns, inv):
        if len(shape) == 1:
            return torch.einsum("xd,dw->xw", c, inv[0]).reshape(shape)
        c = c.reshape(*c.shape[:-1], ns[0], ns[1])
        y = torch.einsum("yxbd,bh,dw->yhxw", c, inv[0], inv[1])
        return y.reshape(shape)

    @torch.no_grad()
    def step(self, apply: bool = True):
        """One DeMo step; ``apply=False`` leaves the parameters to the caller (``last_decoded``)."""
        world = dist.get_world_size(self.group)
        self.last_decoded = []
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
            elif self.encoding == "scaled_sign":  # every kept value becomes +-(mean |kept|) of its block
                magnitude = val.abs().sum(-1, keepdim=True) / k
                val = torch.where(val < 0, -magnitude, magnitude)
            own = torch.zeros_like(coeffs).scatter(-1, idx, val)
            delta.sub_(self._decode(own, p.shape, ns, inv))
            if self.encoding == "sign":
                val = torch.where(val < 0, -1.0, 1.0).to(p.dtype)
            all_idx = [torch.empty_like(idx) for _ in range(world)]
            all_val = [torch.empty_like(val) for _ in range(world)]
            dist.all_gather(all_idx, idx, group=self.group)
            dist.all_gather(all_val, val, group=self.group)
            dense = torch.zeros_like(coeffs).scatter_reduce(
                -1, torch.cat(all_idx, -1), torch.cat(all_val, -1), reduce="mean", include_self=False
            )
            decoded = self._decode(dense, p.shape, ns, inv)
            self.last_decoded.append(decoded)
            if apply:
                p.sub_(self.lr * decoded.sign())


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
