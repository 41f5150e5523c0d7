"""flexdemo TrainSpecs: a stock torchtitan family with flexdemo's parallelize,
optimizer, tokenizer/dataloader and metrics builders swapped in, and the family's validator
rewound before each validation (flexdemo.titan.validation); model, loss, LR schedulers,
pipelining and state-dict adapter are the family's own."""

import dataclasses

from torchtitan.protocols.train_spec import TrainSpec

from .dataloader import build_dataloader, build_tokenizer
from .flavors import EXTRA_FLAVORS
from .metrics import build_flexdemo_metrics_processor
from .optimizer_builder import build_flexdemo_optimizers
from .parallelize import wrap_parallelize
from .torchtitan_workarounds import with_job_config
from .validation import wrap_validator_builder

# flexdemo spec name -> torchtitan model family it wraps (all shipped in 0.2.2).
FAMILIES = {
    "flexdemo_llama3": "llama3",
    "flexdemo_qwen3": "qwen3",
}


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
