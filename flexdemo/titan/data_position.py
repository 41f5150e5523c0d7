"""A checkpointed position in flexdemo's corpora loaded where the data-parallel world size changed
since the save (replicas x shards, what torchtitan's dataloader is built for): written once for
both torchtitan versions. torchtitan's ParallelAwareDataloader (0.2.2 and 0.3.0 alike) saves
``dp_rank_{r}`` (its StatefulDataLoader state, pickled) and ``world_size``, and refuses another
world size (an assertion when it shrinks, a missing DCP key when it grows); the rule that carries
the position over is flexdemo.data.resharding's.

:class:`ReshardingMixin` goes before ParallelAwareDataloader in a loader's bases (0.2.2:
flexdemo.titan.data.ReshardingDataloader; 0.3.0: flexdemo.titan.v0_3.data.FlexDataLoader);
:func:`saved_world_size_to_reshard` reads what it needs from the checkpoint torchtitan will load
(a 0.2.2 job config, or 0.3.0's seen through 0.2.2's names: flexdemo.titan.v0_3.legacy)."""

from __future__ import annotations

import pickle
from typing import Any

from torchtitan.tools.logging import logger

from flexdemo.data.resharding import dataset_state_in, reshard_dataset_states, saved_data_parallel_ranks

from . import elastic
from .checkpoint import checkpoint_to_resume, saved_keys


class ReshardingMixin:
    """A ParallelAwareDataloader over a StdlibTextDataset whose checkpointed position also loads
    where the data-parallel world size changed.

    ``reshard_from(saved_world_size)`` (after the loader's own ``__init__``): the number of
    data-parallel ranks of the checkpoint that torchtitan is about to load (None: nothing to load,
    or the same number). Until that load, ``state_dict()`` asks DCP for every saved rank's state;
    ``load_state_dict`` then gives this rank its share by :func:`reshard_dataset_states`. Saved on
    the same world size, it is torchtitan's own."""

    _reshard_from: int | None = None

    def reshard_from(self, saved_world_size: int | None) -> None:
        self._reshard_from = saved_world_size if saved_world_size not in (None, self.dp_world_size) else None

    def state_dict(self) -> dict[str, Any]:
        if self._reshard_from is not None:  # the keys DCP is to load (values: placeholders)
            return {**{f"dp_rank_{r}": b"" for r in range(self._reshard_from)}, "world_size": self._reshard_from}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved, self._reshard_from = self._reshard_from, None
        if saved is None or not state_dict or state_dict.get("world_size") == self.dp_world_size:
            super().load_state_dict(state_dict)
            return
        if int(state_dict["world_size"]) != saved:
            raise RuntimeError(f"dataloader state written by {state_dict['world_size']} data-parallel ranks, "
                               f"expected {saved}")
        states = [dataset_state_in(pickle.loads(state_dict[f"dp_rank_{r}"])) for r in range(saved)]
        dataset = self.dataset
        dataset.load_state_dict(reshard_dataset_states(
            states, len(dataset._documents), self.dp_rank, self.dp_world_size, dataset._seed))
        logger.info(
            f"{dataset.dataset_name}: position saved by {saved} data-parallel ranks resharded onto "
            f"{self.dp_world_size}: dp rank {self.dp_rank} first reads {len(dataset._pending)} documents "
            f"left unread in the saved epochs and {len(dataset._token_buffer)} buffered tokens, then its "
            f"own documents from epoch {dataset._epoch}"
        )

    def __iter__(self):
        self._reshard_from = None  # loaded or not, from now on state_dict() is this rank's own
        return super().__iter__()


def saved_world_size_to_reshard(job_config, dp_rank: int = 0) -> int | None:
    """The data-parallel world size of the dataloader states torchtitan will load at start, or
    None (nothing to load, or the dataloader excluded from loading, or an elastic replica's)."""
    if "dataloader" in (job_config.checkpoint.exclude_from_loading or []):
        return None
    path = checkpoint_to_resume(job_config)
    if path is None:
        return None
    keys = saved_keys(path)
    if elastic.enabled(job_config):
        # Each elastic replica saves only its own ranks' positions, in a data world fixed by
        # group_size: loaded as they are, never resharded.
        if f"dataloader.dp_rank_{dp_rank}" not in keys:
            raise ValueError(f"{path} holds no data position for data rank {dp_rank} (replica_id "
                             f"{job_config.fault_tolerance.replica_id}): resume an elastic replica from its own "
                             "checkpoint folder, with the same replica_id, group_size and GPUs per replica")
        return None
    return saved_data_parallel_ranks(keys) or None
