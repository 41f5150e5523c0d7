"""Fused Triton kernels: the CUDA fast path of :mod:`flexdemo.compression`.

One file per phase: ``encode`` (momentum update + DCT + top-k + error feedback), ``decode``
(mean over selecting replicas + inverse DCT + sign update or dense output), ``pack`` (bit
streams); ``tables`` holds the glue of grouped (multi-tensor) launches and ``common`` what
they all share. Results are tested against the torch path in Triton's CPU interpreter.
"""

from flexdemo.kernels.common import HAVE_TRITON, INTERPRET, MAX_BLOCK, MAX_TOPK, fused_supported, triton_cache_dir
from flexdemo.kernels.decode import (
    fused_decode_update,
    fused_mean_decode_many,
    fused_mean_decode_update,
    fused_mean_decode_update_many,
)
from flexdemo.kernels.encode import fused_encode, fused_encode_many
from flexdemo.kernels.pack import fused_pack_payload, fused_unpack_payload, fused_voters_first
from flexdemo.kernels.tables import group_block_offsets, group_key

__all__ = [
    "HAVE_TRITON",
    "INTERPRET",
    "MAX_BLOCK",
    "MAX_TOPK",
    "fused_supported",
    "triton_cache_dir",
    "fused_encode",
    "fused_encode_many",
    "fused_decode_update",
    "fused_mean_decode_update",
    "fused_mean_decode_update_many",
    "fused_mean_decode_many",
    "fused_pack_payload",
    "fused_voters_first",
    "fused_unpack_payload",
    "group_key",
    "group_block_offsets",
]
