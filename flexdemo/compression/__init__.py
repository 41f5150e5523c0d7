"""What travels over the slow link, independent of why it is sent: the top-k payload codec
(torch ops; the bytes are :mod:`flexdemo.wire`'s), the bucketed payload plan, the torch-or-fused
choice per bucket, the collectives over the replica group, the replicas' start-up agreement, and
:class:`TopkCompressor`, the one compression path both modes call."""

from flexdemo.compression.compressor import TopkCompressor

__all__ = ["TopkCompressor"]
