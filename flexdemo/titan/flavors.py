"""Extra model flavors sized for flexdemo's offline corpus (2048-token BPE vocab).

The stock flavors stay available (e.g. llama3 "debugmodel", "8B"); a stock flavor with a
larger vocab also works with the small tokenizer (unused embedding rows).
"""

import dataclasses

from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.qwen3 import qwen3_args

LLAMA3_EXTRA = {
    # ~77M params: a quick GPU model whose dims are multiples of 64 (whole DCT blocks).
    "small": TransformerModelArgs(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=2048,
        multiple_of=256, rope_theta=500000,
    ),
    # Llama-3.2-1B shape (dim 2048, 16 layers, GQA 32/8, ffn 8192) with a 2048 vocab: ~0.98B.
    "1B": TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=2048,
        ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000,
    ),
}

# qwen3's stock small flavors tie tok_embeddings and output weights, which torchtitan
# 0.2.2's FSDP wrapping (separate fully_shard groups) rejects under torch 2.13, in
# stock HSDP as well.  Untied copies train with either mode.
QWEN3_EXTRA = {
    f"{name}_untied": dataclasses.replace(qwen3_args[name], enable_weight_tying=False)
    for name in ("debugmodel", "0.6B", "1.7B")
}

EXTRA_FLAVORS = {"llama3": LLAMA3_EXTRA, "qwen3": QWEN3_EXTRA}
