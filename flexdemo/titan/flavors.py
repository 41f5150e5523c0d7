"""flexdemo's extra model flavors, written once for both torchtitan adapters (no torchtitan here):
0.2.2 makes them TransformerModelArgs / qwen3 args (flexdemo.titan.spec), 0.3.0 model Configs
(flexdemo.titan.v0_3.model). Sized for flexdemo's offline corpus (2048-token BPE vocab).
"""

# llama3: flavor -> (the stock flavor it derives from or None, the model args it sets; 0.2.2's
# TransformerModelArgs names).
LLAMA3 = {
    # debugmodel with 2 of its 6 layers: the CPU configs' model (every kind of parameter, a step
    # in under half the time on 2 cores, and the same fall of the loss over 20 steps).
    "debugmodel_2layer": ("debugmodel", {"n_layers": 2}),
    # ~77M params: a quick GPU model whose dims are multiples of 64 (whole DCT blocks).
    "small": (None, {"dim": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "vocab_size": 2048,
                     "multiple_of": 256, "rope_theta": 500000}),
    # Llama-3.2-1B shape (dim 2048, 16 layers, GQA 32/8, ffn 8192) with a 2048 vocab: ~0.98B.
    "1B": (None, {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 2048,
                  "ffn_dim_multiplier": 1.5, "multiple_of": 256, "rope_theta": 500000}),
}

# qwen3's stock small flavors tie tok_embeddings and output weights, which torchtitan 0.2.2's FSDP
# wrapping (separate fully_shard groups) rejects under torch 2.13, in stock HSDP as well. Untied
# copies ("<stock>_untied") train with either mode.
QWEN3_UNTIED = ("debugmodel", "0.6B", "1.7B")
