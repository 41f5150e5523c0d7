"""The compute step of a config on a named GPU: a measured step of its flavor (evidence.COMPUTE_STEPS)
scaled by the config's tokens per GPU, or, for a flavor not measured on that GPU, the GPU's 8B
(else 1B) step scaled by training FLOPs per token (torchtitan's own count: 6 x parameters + attention),
labelled modelled. Full activation checkpointing adds a forward: x 4/3 (modelled)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from flexdemo.titan import memory

from .evidence import COMPUTE_STEPS, ComputeStep

FULL_AC_FACTOR = 4 / 3  # forward + backward = 3 forwards; full AC recomputes one more
REFERENCE_FLAVORS = ("8B", "1B")  # the largest measured flavor on the GPU scales to the others


@dataclass(frozen=True)
class Step:
    seconds: float
    how: str  # "measured: <source>" or "modelled: <how>"


class UnknownComputeStep(ValueError):
    pass


def _ac_factor(mode: str) -> float:
    return FULL_AC_FACTOR if mode == "full" else 1.0


def _flops_per_token(job_config, flavor: str, seq_len: int) -> float:
    jc = job_config
    if flavor != jc.model.flavor:
        jc = copy.deepcopy(job_config)
        jc.model.flavor = flavor
    model = memory.build_meta_model(jc)
    return model.model_args.get_nparams_and_flops(model, seq_len)[1]


def compute_step(job_config, gpu: str) -> Step:
    """One AdamW training step on one ``gpu`` at the config's batch, without replica traffic."""
    t, ac = job_config.training, job_config.activation_checkpoint.mode
    tp = job_config.parallelism.tensor_parallel_degree
    tokens = t.local_batch_size * t.seq_len
    flavor = job_config.model.flavor
    ref: ComputeStep | None = COMPUTE_STEPS.get((flavor, gpu))
    if ref is not None:
        seconds = ref.seconds * tokens / tp / ref.tokens_per_gpu * _ac_factor(ac) / _ac_factor(ref.activation_checkpoint)
        kind = "modelled" if ref.modelled else "measured"
        return Step(seconds, f"{kind}: {ref.source}, scaled to {tokens // tp} tokens per GPU")
    base = next((f for f in REFERENCE_FLAVORS if (f, gpu) in COMPUTE_STEPS), None)
    if base is None:
        known = sorted({g for _, g in COMPUTE_STEPS})
        raise UnknownComputeStep(f"no step time for GPU {gpu!r} (known: {', '.join(known)}): give --step-seconds")
    ref = COMPUTE_STEPS[(base, gpu)]
    ratio = _flops_per_token(job_config, flavor, t.seq_len) / _flops_per_token(job_config, base, ref.seq_len)
    seconds = (ref.seconds * ratio * tokens / tp / ref.tokens_per_gpu
               * _ac_factor(ac) / _ac_factor(ref.activation_checkpoint))
    return Step(seconds, f"modelled: the {base} step on {gpu} x {ratio:.2f} training FLOPs per token "
                         f"({flavor}, seq {t.seq_len}), {tokens // tp} tokens per GPU, AC {ac}")
