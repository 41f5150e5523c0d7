"""Held-out validation that scores the same batches every time.

torchtitan 0.2.2's validator keeps one dataloader and continues it where the previous
validation stopped, so each validation scores different text: the logged curve mixes the
model's progress with how hard each slice of the held-out split is (measured: a 1B run's
validation loss moved 3.09 -> 2.83 between steps 896 and 1024 and a dense DiLoCo run's
3.63 -> 2.64 within 200 steps). ``[flexdemo] validation_same_batches`` (default on) rewinds
that dataloader to its starting state before every validation, so the curve compares one
model against itself on fixed data and a resumed run scores what the uninterrupted one did.
The family's own validator does the work; this only rewinds its dataloader.
"""

from __future__ import annotations

import copy
from typing import Any, Callable


class SameBatchesValidator:
    """Wraps a torchtitan validator (anything with ``validation_dataloader``, ``validate``
    and ``should_validate``); every other attribute is the wrapped one's."""

    def __init__(self, inner: Any):
        self.inner = inner
        if not hasattr(inner, "validation_dataloader"):
            raise TypeError(
                f"[flexdemo] validation_same_batches: {type(inner).__name__} has no validation_dataloader "
                "to rewind; set validation_same_batches = false for this model family's validator"
            )
        # The dataloader's state before it has yielded anything: torchtitan's stateful
        # loaders restore it (and the dataset's sample index and token buffer) on load.
        self._start = copy.deepcopy(inner.validation_dataloader.state_dict())

    def should_validate(self, step: int) -> bool:
        return self.inner.should_validate(step)

    def validate(self, model_parts, step: int):
        self.inner.validation_dataloader.load_state_dict(copy.deepcopy(self._start))
        return self.inner.validate(model_parts, step)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class ConsensusValidator:
    """Scores the replicas' common parameters: ``consensus`` (a context manager, the optimizers
    container's) puts them in the model for the validation (overlap_lookahead: the live
    parameters hold each replica's own look-ahead). Every other attribute is the wrapped one's."""

    def __init__(self, inner: Any, consensus: Callable[[], Any]):
        self.inner, self._consensus = inner, consensus

    def validate(self, model_parts, step: int):
        with self._consensus():
            return self.inner.validate(model_parts, step)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def wrap_validator_builder(build_validator: Callable[..., Any]) -> Callable[..., Any]:
    """The family's ``build_validator_fn``, its validator wrapped when the key asks for it."""

    def build(*args, **kwargs):
        validator = build_validator(*args, **kwargs)
        job_config = kwargs.get("job_config", args[0] if args else None)
        section = getattr(job_config, "flexdemo", None)
        if section is not None and section.validation_same_batches:
            return SameBatchesValidator(validator)
        return validator

    return build
