"""Validator wrappers, independent of the torchtitan version (they wrap whatever validator it
builds): :class:`SameBatchesValidator` (``[flexdemo] validation_same_batches``) and
:class:`ConsensusValidator` (``overlap_lookahead``). Re-exported by flexdemo.titan.metrics."""

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
