"""flexdemo's corpora as a token stream: the dataset names, the per-epoch document order and
:class:`StdlibTextDataset`. Needs torch only; torchtitan's dataloader around it and the builders
torchtitan calls live in flexdemo.titan.data.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol, Sequence

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

DATASET_NAME = "flexdemo_stdlib"
VALIDATION_DATASET_NAME = "flexdemo_stdlib_validation"
PYSOURCE_DATASET_NAME = "flexdemo_pysource"
PYSOURCE_VALIDATION_DATASET_NAME = "flexdemo_pysource_validation"
# The comparison corpus (flexdemo.data.pysource2): held out by installed distribution, decontaminated.
PYSOURCE2_DATASET_NAME = "flexdemo_pysource2"
PYSOURCE2_VALIDATION_DATASET_NAME = "flexdemo_pysource2_validation"
# dataset name -> (corpus, split)
SPLITS = {
    DATASET_NAME: ("stdlib", "train"),
    VALIDATION_DATASET_NAME: ("stdlib", "validation"),
    PYSOURCE_DATASET_NAME: ("pysource", "train"),
    PYSOURCE_VALIDATION_DATASET_NAME: ("pysource", "validation"),
    PYSOURCE2_DATASET_NAME: ("pysource2", "train"),
    PYSOURCE2_VALIDATION_DATASET_NAME: ("pysource2", "validation"),
}

# The root logger, which is torchtitan's logger: lines look like torchtitan's own.
logger = logging.getLogger()


class Tokenizer(Protocol):
    """What the dataset asks of a tokenizer (torchtitan's BaseTokenizer has it)."""

    def encode(self, text: str, add_bos: bool = ..., add_eos: bool = ...) -> list[int]: ...


def is_embedded_dataset(name: str | None) -> bool:
    """One of flexdemo's corpora (whose checkpointed position reshards), not torchtitan's."""
    return bool(name) and name.lower() in SPLITS


def document_order(num_docs: int, seed: int, epoch: int) -> list[int]:
    """A fresh document order per epoch, from sha256 only (same on every Python/OS)."""
    key = f"{seed}:{epoch}:".encode()
    return sorted(range(num_docs), key=lambda i: hashlib.sha256(key + str(i).encode()).digest())


class StdlibTextDataset(IterableDataset, Stateful):
    """Token stream of seq_len+1 windows, same contract as torchtitan's HuggingFaceTextDataset.

    Rank r of W owns documents r, r+W, r+2W, ... (disjoint, balanced), read in a fresh order
    each epoch. Each document is encoded with BOS/EOS, appended to a buffer and cut into
    ({"input": x[:-1]}, x[1:]) samples. The state (epoch, document index, buffer, and the
    documents handed over by a resharding, read first) is all a resume needs to continue
    bit-exactly.
    """

    def __init__(
        self,
        documents: Sequence[str],
        tokenizer: Tokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
        seed: int = 0,
        name: str = DATASET_NAME,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_world_size {dp_world_size}")
        self._documents = documents
        self._docs = list(documents[dp_rank::dp_world_size])
        if not self._docs:
            raise ValueError(
                f"{name}: {len(documents)} documents cannot feed {dp_world_size} data-parallel ranks"
            )
        self.dataset_name = name
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        self._seed = seed
        # Checkpointed state.
        self._epoch = 0
        self._sample_idx = 0
        self._token_buffer: list[int] = []
        # Documents (indices into ``documents``) handed to this rank by a resharding, read before
        # its own order of ``_epoch`` (from ``_sample_idx``) goes on; empty once read.
        self._pending: list[int] = []
        self._pending_idx = 0

    def _windows(self, text: str):
        self._token_buffer.extend(self._tokenizer.encode(text, add_bos=True, add_eos=True))
        window = self.seq_len + 1
        while len(self._token_buffer) >= window:
            x = torch.LongTensor(self._token_buffer[:window])
            self._token_buffer = self._token_buffer[window:]
            yield {"input": x[:-1]}, x[1:]

    def __iter__(self):
        while True:
            while self._pending_idx < len(self._pending):
                text = self._documents[self._pending[self._pending_idx]]
                self._pending_idx += 1
                if self._pending_idx == len(self._pending):
                    self._pending, self._pending_idx = [], 0
                yield from self._windows(text)
            order = document_order(len(self._docs), self._seed, self._epoch)
            while self._sample_idx < len(order):
                text = self._docs[order[self._sample_idx]]
                self._sample_idx += 1
                yield from self._windows(text)
            if not self.infinite:
                logger.warning(f"Dataset {self.dataset_name} has run out of data")
                return
            self._epoch += 1
            self._sample_idx = 0
            logger.info(f"Dataset {self.dataset_name} starts epoch {self._epoch}")

    def state_dict(self) -> dict[str, Any]:
        # A copy: the live buffer is extended in place after this call.
        return {
            "epoch": self._epoch,
            "sample_idx": self._sample_idx,
            "token_buffer": list(self._token_buffer),
            "pending": list(self._pending),
            "pending_idx": self._pending_idx,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = int(state_dict["epoch"])
        self._sample_idx = int(state_dict["sample_idx"])
        self._token_buffer = list(state_dict["token_buffer"])
        self._pending = list(state_dict.get("pending", ()))  # absent in checkpoints of before
        self._pending_idx = int(state_dict.get("pending_idx", 0))
