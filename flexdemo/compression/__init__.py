"""What travels over the slow link, independent of why it is sent: the chunked DCT, bit
packing, the top-k payload codec, the bucketed payload plan, the collectives over the replica
group, and :class:`TopkCompressor`, the one compression path both modes call."""

from flexdemo.compression.compressor import TopkCompressor

__all__ = ["TopkCompressor"]
