"""flexdemo's TrainSpecs: a stock torchtitan family with flexdemo's parallelize, optimizer,
tokenizer/dataloader and metrics builders swapped in, and the family's validator rewound before
each validation (flexdemo.titan.metrics.SameBatchesValidator); model, loss, LR schedulers,
pipelining and state-dict adapter are the family's own. ``register_specs`` registers them under
the names a config's ``[model] name`` takes (flexdemo.titan.register, the ``custom_import``).

The extra model flavors (flexdemo.titan.flavors, shared with the 0.3.0 adapter) are sized for
flexdemo's offline corpus (2048-token BPE vocab). The stock
flavors stay available (e.g. llama3 "debugmodel", "8B"); a stock flavor with a larger vocab also
works with the small tokenizer (unused embedding rows).
"""

import dataclasses

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from . import flavors
from .data import build_dataloader, build_tokenizer
from .metrics import build_flexdemo_metrics_processor, wrap_validator_builder
from .optimizer import build_flexdemo_optimizers
from .parallelize import wrap_parallelize
from .torchtitan_workarounds import with_job_config

# flexdemo spec name -> torchtitan model family it wraps (all shipped in 0.2.2).
FAMILIES = {
    "flexdemo_llama3": "llama3",
    "flexdemo_qwen3": "qwen3",
}

LLAMA3_EXTRA = {
    name: dataclasses.replace(llama3_args[stock], **args) if stock else TransformerModelArgs(**args)
    for name, (stock, args) in flavors.LLAMA3.items()
}
QWEN3_EXTRA = {
    f"{name}_untied": dataclasses.replace(qwen3_args[name], enable_weight_tying=False)
    for name in flavors.QWEN3_UNTIED
}

EXTRA_FLAVORS = {"llama3": LLAMA3_EXTRA, "qwen3": QWEN3_EXTRA}


def flexdemo_spec(base: TrainSpec, extra_flavors=None) -> TrainSpec:
    parallelize, build_optimizers = with_job_config(wrap_parallelize(base.parallelize_fn), build_flexdemo_optimizers)
    return dataclasses.replace(
        base,
        model_args={**base.model_args, **(extra_flavors or {})},
        parallelize_fn=parallelize,
        build_optimizers_fn=build_optimizers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_metrics_processor_fn=build_flexdemo_metrics_processor,
        build_validator_fn=base.build_validator_fn and wrap_validator_builder(base.build_validator_fn),
    )


def family_spec(family: str) -> TrainSpec:
    from importlib import import_module

    base = import_module(f"torchtitan.models.{family}").get_train_spec()
    return flexdemo_spec(base, EXTRA_FLAVORS.get(family))


def register_specs() -> None:
    """Register every flexdemo spec with torchtitan (once per process: see flexdemo.titan.register)."""
    for name, family in FAMILIES.items():
        register_train_spec(name, family_spec(family))
