"""A deliberately plain DiLoCo outer step, written independently of flexdemo for the tests.

Full (unsharded) tensors, one at a time; the dense mean by an explicit all_gather of every
replica's whole pseudo-gradient, summed in rank order; the top-k variant with the FFT-built
DCT bases of reference_demo (einsum transforms, int64 indices, two all_gathers per tensor, each
block's own top-k, the mean over the values sent as scatter_add sums over counts); the outer optimizer is ``torch.optim.SGD`` itself.
``transform="none"`` (SparseLoCo): identity matrices in place of the DCT bases.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference_demo import (ReferenceDeMo, ragged_topk, recompress_mean, reference_block_topks, reference_two_levels,
                            scatter_rows, sharded_block_topks)


class ReferenceDiLoCo:
    def __init__(self, params, *, lr, momentum, nesterov, compression, encoding, topk=32, chunk=64, decay=0.9,
                 group=None, sharded_topk=None, transform="dct"):
        # sharded_topk: the sharded exchange's re-compression of the mean (None: all_gather).
        self.sharded_topk = sharded_topk
        self.params = list(params)
        self.globals = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.outer = torch.optim.SGD(self.globals, lr=lr, momentum=momentum, nesterov=nesterov, foreach=False)
        self.compression, self.encoding, self.group = compression, encoding, group
        self.topk, self.decay, self.transform = topk, decay, transform
        self.ef = [torch.zeros_like(p) for p in self.params]
        # Reuse reference_demo's independent DCT (bases from an FFT, einsum transforms).
        self.dct = ReferenceDeMo(self.params, lr=1.0, decay=0.0, topk=topk, chunk=chunk, weight_decay=0.0,
                                 encoding="fp32", group=group)

    def _gather(self, t):
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def _dense_mean(self, pg):
        wire = {"fp32": torch.float32, "bf16": torch.bfloat16}[self.encoding]
        total = torch.zeros_like(pg)
        parts = self._gather(pg.to(wire))
        for part in parts:  # rank order
            total += part.to(torch.float32)
        return (total / len(parts)).to(wire).to(torch.float32)

    def _topk_mean(self, i, pg):
        ef, p = self.ef[i], self.params[i]
        ef.mul_(self.decay).add_(pg)
        ns, fwd, inv = self.dct._bases(p)
        if self.transform == "none":
            fwd = inv = [torch.eye(n, dtype=p.dtype) for n in ns]
        coeffs = self.dct._encode(ef, ns, fwd)
        ks = reference_block_topks(tuple(p.shape), self.topk, self.dct.chunk)  # a row's unused slots: value 0
        idx, val = ragged_topk(coeffs, ks)
        if self.encoding == "bf16":
            val = val.to(torch.bfloat16).to(p.dtype)
        elif self.encoding == "two_bit":
            val = reference_two_levels(val)
        elif self.encoding == "scaled_sign":
            magnitude = val.abs().sum(-1, keepdim=True) / torch.tensor(ks, dtype=val.dtype).reshape(*val.shape[:-1], 1)
            val = torch.where(val < 0, -magnitude, torch.where(val > 0, magnitude, 0.0))
        own = scatter_rows(coeffs, idx, val)
        ef.sub_(self.dct._decode(own, p.shape, ns, inv))
        all_idx, all_val = torch.cat(self._gather(idx), -1), torch.cat(self._gather(val), -1)
        # the mean over the values sent for each coefficient (a zero value is no vote)
        total = torch.zeros_like(coeffs).scatter_add(-1, all_idx, all_val)
        count = torch.zeros_like(coeffs).scatter_add(-1, all_idx, (all_val != 0).to(coeffs.dtype))
        dense = total / count.clamp_min(1)
        if self.sharded_topk is not None:
            k2 = sharded_block_topks(ks, self.sharded_topk, self.topk, coeffs.shape[-1])
            dense = recompress_mean(all_idx, all_val, dense, k2, self.encoding)
            ef.add_(self.dct._decode(torch.where(dense != 0, 0.0, own), p.shape, ns, inv))  # what was not applied
        return self.dct._decode(dense, p.shape, ns, inv)

    @torch.no_grad()
    def sync(self):
        for i, (p, g) in enumerate(zip(self.params, self.globals)):
            pg = g.detach() - p.detach()
            g.grad = self._dense_mean(pg) if self.compression == "dense" else self._topk_mean(i, pg)
        self.outer.step()
        for p, g in zip(self.params, self.globals):
            p.copy_(g)
