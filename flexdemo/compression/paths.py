"""The two ways a bucket is encoded, packed, unpacked and decoded, and the one rule that picks.

:class:`TorchPath` calls the torch ops of :mod:`flexdemo.compression.codec`; :class:`FusedPath`
calls the Triton kernels of :mod:`flexdemo.kernels`. They have the same methods and write and
read the same bytes (:mod:`flexdemo.wire.format`). :func:`choose_path` gives a bucket the fused
path when asked for it, its blocks keep one k, and every member fits the kernels (:func:`flexdemo.kernels.fused_supported`:
CUDA, fp32, >= 1-D, blocks <= 64x64, contiguous); otherwise the torch path. The compressor
(:mod:`flexdemo.compression.compressor`) calls ``bucket.path`` and never branches on it.
"""

from __future__ import annotations

import torch

from flexdemo.compression.codec import compress, decode_mean, pack_blocks, pack_payload, unpack_blocks, unpack_payload
from flexdemo.kernels import (
    fused_encode_many,
    fused_mean_decode_many,
    fused_mean_decode_update_many,
    fused_pack_payload,
    fused_supported,
    fused_unpack_payload,
)
from flexdemo.local import local_tensor
from flexdemo.wire.dct import BlockLayout


# The value encodings the Triton kernels write (two_bit's levels are torch ops only).
FUSED_ENCODINGS = ("fp32", "bf16", "sign", "scaled_sign")


class TorchPath:
    """Torch ops, on any device and dtype."""

    fused = False

    def __init__(self, encoding: str, precision: str, index_coding: str = "fixed"):
        self.encoding = encoding  # ``precision`` is the kernels' only: the torch path has none
        self.index_coding = index_coding

    def encode(self, accs, incs, scale: float, decay: float, layouts: list[BlockLayout], k: int,
               skip_incs: torch.Tensor | None, row_ks: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per accumulator ``acc = decay * acc + scale * inc``, top-k, error feedback; the rows
        ``[B, k]`` of all of them, in order. ``row_ks``: per accumulator its blocks' own top-k
        (a device tensor) where they differ, else None."""
        idx_parts, val_parts = [], []
        for i, (acc, inc, layout) in enumerate(zip(accs, incs, layouts)):
            if decay != 1.0:
                acc.mul_(decay)
            if inc is not None:
                acc.add_(inc if skip_incs is None else torch.where(skip_incs != 0, 0.0, inc), alpha=scale)
            idx, vals = compress(acc, layout, k, self.encoding, row_ks[i] if row_ks else None)
            idx_parts.append(idx)
            val_parts.append(vals)
        return torch.cat(idx_parts), torch.cat(val_parts)

    def pack(self, idx: torch.Tensor, vals: torch.Tensor, block_numel: int, per_block=None) -> torch.Tensor:
        return pack_blocks(idx, vals, per_block, block_numel, self.encoding, self.index_coding)

    def unpack(self, payloads: torch.Tensor, num_blocks: int, k: int, block_numel: int,
               dtype: torch.dtype, per_block=None) -> tuple[torch.Tensor, torch.Tensor]:
        return unpack_blocks(payloads, num_blocks, k, per_block, block_numel, self.encoding, dtype, self.index_coding)

    def decode_sign_update(self, members, targets: list[torch.Tensor], idx, vals, lr, scale: float) -> None:
        """``target = target * scale - lr * sign(decode)`` per member; ``lr`` a float, or one fp32
        per member on the device."""
        for i, (m, t) in enumerate(zip(members, targets)):
            rows = slice(m.first_block, m.first_block + m.layout.num_blocks)
            if scale != 1.0:
                t.mul_(scale)
            signs = decode_mean(idx[:, rows], vals[:, rows], m.layout).sign_()
            if not (isinstance(lr, torch.Tensor) and lr.dim() == 1):
                t.add_(signs, alpha=-lr)
            else:  # -lr_i * sign is exact (sign is -1, 0 or 1): the same bits as alpha=-lr
                t.add_(signs.mul_(-lr[i].to(t.dtype)))

    def decode(self, idx: torch.Tensor, vals: torch.Tensor, layout: BlockLayout, out: torch.Tensor) -> None:
        """``out = IDCT(mean over selecting replicas)`` of one tensor's rows ``[W, B, k]``."""
        out.copy_(decode_mean(idx, vals, layout))


class FusedPath:
    """The Triton kernels: CUDA (or the CPU under ``TRITON_INTERPRET=1``), fp32."""

    fused = True

    def __init__(self, encoding: str, precision: str, index_coding: str = "fixed"):
        self.encoding = encoding
        self.precision = precision  # tl.dot's: "tf32x3" or "ieee"
        # The pack/unpack kernels write fixed-width indices; Elias-Fano ones are torch ops (on
        # the same device), between the fused encode and the fused decode.
        self.index_coding = index_coding

    def encode(self, accs, incs, scale: float, decay: float, layouts: list[BlockLayout], k: int,
               skip_incs: torch.Tensor | None, row_ks: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert not any(r is not None for r in row_ks or []), "blocks of different k take the torch path"
        return fused_encode_many(accs, incs, scale, decay, layouts, k, self.encoding,
                                 precision=self.precision, skip_grad=skip_incs)

    def pack(self, idx: torch.Tensor, vals: torch.Tensor, block_numel: int, per_block=None) -> torch.Tensor:
        assert per_block is None, "blocks of different k take the torch path"
        if self.index_coding != "fixed":
            return pack_payload(idx, vals, block_numel, self.encoding, self.index_coding)
        return fused_pack_payload(idx, vals, block_numel, self.encoding)

    def unpack(self, payloads: torch.Tensor, num_blocks: int, k: int, block_numel: int,
               dtype: torch.dtype, per_block=None) -> tuple[torch.Tensor, torch.Tensor]:
        assert per_block is None, "blocks of different k take the torch path"
        # fp32 values, int32 indices: a fused bucket's dtype is fp32
        if self.index_coding != "fixed":
            return unpack_payload(payloads, num_blocks, k, block_numel, self.encoding, torch.float32,
                                  self.index_coding)
        return fused_unpack_payload(payloads, num_blocks, k, block_numel, self.encoding)

    def decode_sign_update(self, members, targets: list[torch.Tensor], idx, vals, lr, scale: float) -> None:
        fused_mean_decode_update_many(targets, idx, vals, lr, [m.layout for m in members],
                                      precision=self.precision, scale=scale)

    def decode(self, idx: torch.Tensor, vals: torch.Tensor, layout: BlockLayout, out: torch.Tensor) -> None:
        fused_mean_decode_many([out], idx.contiguous(), vals.contiguous(), [layout], precision=self.precision)


def choose_path(bucket, fused: bool, encoding: str, precision: str, k_read: int | None = None) -> TorchPath | FusedPath:
    """The fused path if ``fused`` and every member of ``bucket`` fits the kernels, else torch.
    ``k_read``: coefficients per block the decode reads, if not the bucket's top-k (the sharded
    exchange's means). Blocks of different k (partial edge blocks: :attr:`Bucket.ragged`) take
    the torch path: the kernels write one k per bucket."""
    k = max(bucket.k, k_read or 0)
    fits = fused and encoding in FUSED_ENCODINGS and not bucket.ragged and all(
        fused_supported(m.layout, local_tensor(m.param).device, m.param.dtype, k)
        and local_tensor(m.param).is_contiguous()
        for m in bucket.members
    )
    return (FusedPath if fits else TorchPath)(encoding, precision, bucket.index_coding)
