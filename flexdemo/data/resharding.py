"""A checkpointed position in flexdemo's corpora, carried onto another data-parallel world size
(the number of ranks the dataloader is built for: replicas x shards). Pure functions of the saved
states; flexdemo.titan.data's ReshardingDataloader applies them when torchtitan loads a
checkpoint.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from .dataset import document_order


def unread_documents(state: dict[str, Any], num_documents: int, dp_rank: int, dp_world_size: int,
                     seed: int) -> tuple[int, list[int]]:
    """``(epoch, documents)``: the epoch that rank ``dp_rank`` of ``dp_world_size`` was reading when
    it saved ``state``, and the documents (indices into the corpus) of it that it had not read yet.
    Documents handed over by a resharding and not all read yet belong to the epoch before
    ``state["epoch"]`` (whose own order has not started); otherwise they are the rest of the
    rank's own order of ``state["epoch"]``."""
    pending = list(state.get("pending", ()))[int(state.get("pending_idx", 0)):]
    if pending:
        return int(state["epoch"]) - 1, pending
    own = range(dp_rank, num_documents, dp_world_size)
    order = document_order(len(own), seed, int(state["epoch"]))
    return int(state["epoch"]), [own[i] for i in order[int(state["sample_idx"]):]]


def reshard_dataset_states(states: Sequence[dict[str, Any]], num_documents: int, dp_rank: int,
                           dp_world_size: int, seed: int) -> dict[str, Any]:
    """The dataset state of rank ``dp_rank`` of ``dp_world_size`` that continues the streams of the
    ``len(states)`` ranks that saved ``states`` (rank order), with nothing read twice or skipped:

    * the documents the saved ranks had not read of the epoch they were in
      (:func:`unread_documents`), listed saved rank by saved rank (each in its own order), are
      dealt round-robin: the new rank ``r`` reads every ``dp_world_size``-th from the ``r``-th
      on, before anything else;
    * the tokens left in the saved ranks' buffers (less than one sample each) stay in the stream:
      saved rank ``s``'s go to the new rank ``s mod dp_world_size``, in saved-rank order;
    * then every new rank reads its own documents (``r::dp_world_size``) in the order of the
      epoch after the latest of the saved ranks' epochs, and so on.

    Every document of the interrupted epoch is read once across the runs, also through several
    reshardings in a row (where the saved ranks were in different epochs, each one's: the
    documents of a rank that was an epoch behind miss that epoch); no token is lost."""
    if not states:
        raise ValueError("reshard_dataset_states: no saved states")
    saved = len(states)
    epochs, unread = [], []
    for s, state in enumerate(states):
        epoch, docs = unread_documents(state, num_documents, s, saved, seed)
        epochs.append(epoch)
        unread += docs
    buffer = [tok for s, state in enumerate(states) if s % dp_world_size == dp_rank for tok in state["token_buffer"]]
    return {
        "epoch": max(epochs) + 1,
        "sample_idx": 0,
        "token_buffer": buffer,
        "pending": unread[dp_rank::dp_world_size],
        "pending_idx": 0,
    }


_DATASET_STATE = "dataset_state"


def dataset_state_in(loader_state: dict[str, Any]) -> dict[str, Any]:
    """The dataset's own state inside a StatefulDataLoader state (0 workers: at the top; 1 worker:
    in the worker's snapshot, taken at every step by default)."""
    if loader_state.get(_DATASET_STATE) is not None:
        return loader_state[_DATASET_STATE]
    if loader_state.get("_steps_since_snapshot", 0):
        raise RuntimeError("dataloader state saved between worker snapshots: its exact position is unknown, "
                           "it cannot be resharded")
    workers = loader_state.get("_snapshot", {}).get("_worker_snapshots", {})
    found = [w[_DATASET_STATE] for w in workers.values() if w.get(_DATASET_STATE) is not None]
    if len(found) != 1:
        raise RuntimeError(f"no dataset state in this dataloader state (keys {sorted(loader_state)})")
    return found[0]


_SAVED_RANK_KEY = re.compile(r"^dataloader\.dp_rank_(\d+)$")


def saved_data_parallel_ranks(checkpoint_keys) -> int:
    """How many data-parallel ranks wrote the dataloader states of a checkpoint (DCP key names);
    0 when it holds none."""
    return len([k for k in checkpoint_keys if _SAVED_RANK_KEY.match(k)])
