"""The model of a run on torchtitan 0.3.0: a family's ``model_registry(flavor)`` (0.3.0 has no
TrainSpec registry) plus flexdemo's extra flavors (flexdemo.titan.flavors, as 0.2.2's
flexdemo.titan.spec has them), the names a flexdemo TOML's ``[model]`` takes.

The extra flavors belong to flexdemo's names (``flexdemo_llama3``, ``flexdemo_qwen3``) and come
before the stock ones there, as on 0.2.2: 0.3.0 ships a stock llama3 ``1B`` (128256 vocab, tied
embeddings) that flexdemo's ``1B`` (2048 vocab, untied) must not silently become.

* llama3 ``debugmodel_2layer``: the stock debugmodel's first 2 layers;
* llama3 ``small``, ``1B``: built as 0.3.0 builds its stock llama3 flavors (fused wqkv, the stock
  inits, llama-scaled complex RoPE) from the 0.2.2 model args in flexdemo.titan.flavors;
* qwen3 ``<stock>_untied``: the stock flavor with its own embedding (initialised as qwen3's
  untied flavors initialise theirs) and ``enable_weight_tying=False``.

Attention is causal SDPA, as 0.2.2's llama3 ran it: 0.3.0's default FlexAttention needs per-document
``positions`` in every batch (to build its BlockMask) and torch.compile; flexdemo's datasets carry
none, so the same text trains the same model on both versions.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module

from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.protocols.model_spec import ModelSpec

from flexdemo.section import FlexDemoConfigError

from .. import flavors

# [model] name -> torchtitan 0.3.0 model family (the 0.2.2 spec names, and the families' own).
FAMILIES = {"flexdemo_llama3": "llama3", "flexdemo_qwen3": "qwen3", "llama3": "llama3", "qwen3": "qwen3"}
# The 0.2.2 TransformerModelArgs defaults the extra llama3 flavors leave as they are.
LLAMA3_DEFAULTS = {"n_kv_heads": None, "ffn_dim_multiplier": None, "multiple_of": 256, "norm_eps": 1e-5,
                   "rope_theta": 10000}


def extra_flavors(name: str) -> list[str]:
    """flexdemo's extra flavors of ``[model] name`` (none for the stock family names)."""
    if not name.startswith("flexdemo_"):
        return []
    family = FAMILIES[name]
    if family == "llama3":
        return list(flavors.LLAMA3)
    if family == "qwen3":
        return [f"{f}_untied" for f in flavors.QWEN3_UNTIED]
    return []


def model_spec(name: str, flavor: str) -> ModelSpec:
    """The ModelSpec of ``[model] name`` / ``flavor``; a FlexDemoConfigError naming what exists."""
    family = FAMILIES.get(name)
    if family is None:
        raise FlexDemoConfigError(f"model.name {name!r} is not a model on torchtitan 0.3.0; "
                                  f"expected one of {sorted(FAMILIES)}")
    registry = import_module(f"torchtitan.models.{family}")
    configs = getattr(registry, f"{family}_configs")
    extra = extra_flavors(name)
    if flavor not in extra and flavor not in configs:
        raise FlexDemoConfigError(f"model.flavor {flavor!r} of {name!r} does not exist on torchtitan 0.3.0; "
                                  f"expected one of {sorted({*configs, *extra})}")
    if flavor in extra and family == "llama3":
        stock, args = flavors.LLAMA3[flavor]
        if stock is not None:  # a stock flavor cut to fewer layers (debugmodel_2layer)
            if set(args) != {"n_layers"}:
                raise FlexDemoConfigError(f"model.flavor {flavor!r}: only n_layers may differ from {stock!r}")
            spec = registry.model_registry(stock)
            spec.model.layers = spec.model.layers[:args["n_layers"]]
        else:
            spec = dataclasses.replace(registry.model_registry("debugmodel"), model=_llama3(registry, **args))
    elif flavor in extra:  # qwen3 <stock>_untied
        spec = registry.model_registry(flavor.removesuffix("_untied"))
        embedding_init = registry._EMBEDDING_INIT  # what qwen3's untied stock flavors (8B...) use
        spec.model.enable_weight_tying = False
        spec.model.tok_embeddings = dataclasses.replace(spec.model.tok_embeddings, param_init=embedding_init)
    else:
        spec = registry.model_registry(flavor)
    model = spec.model
    for _fqn, _cfg, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    return dataclasses.replace(spec, flavor=flavor)


def _llama3(registry, **args):
    """0.3.0's Llama3Model.Config of 0.2.2's llama3 TransformerModelArgs ``args`` (no weight tying,
    as 0.2.2's llama3), built as 0.3.0 builds its stock flavors."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim

    a = {**LLAMA3_DEFAULTS, **args}
    dim, n_heads, vocab = a["dim"], a["n_heads"], a["vocab_size"]
    return registry.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=registry._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=a["norm_eps"], param_init=registry._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=registry._output_linear_init(dim)),
        layers=[dataclasses.replace(layer, attention_norm=dataclasses.replace(layer.attention_norm, eps=a["norm_eps"]),
                                    ffn_norm=dataclasses.replace(layer.ffn_norm, eps=a["norm_eps"]))
                for layer in registry._build_llama3_layers(
                    fuse_qkv=True, n_layers=a["n_layers"], dim=dim, n_heads=n_heads, n_kv_heads=a["n_kv_heads"],
                    hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=a["multiple_of"],
                                                      ffn_dim_multiplier=a["ffn_dim_multiplier"]),
                    rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=131072, theta=a["rope_theta"],
                                            scaling="llama"),
                    attn_backend="flex")],  # swapped for causal SDPA by model_spec
    )
