"""The held-out set as one fixed token sequence that every layout and seed reads identically.

The held-out documents, each encoded with BOS and EOS, are joined in corpus order and cut into
``N`` windows of ``seq_len + 1`` tokens, ``N`` the largest multiple of ``WINDOW_MULTIPLE`` that
fits (the tail is left out). Rank ``r`` of ``W`` reads windows ``r, r + W, r + 2W, ...``, so a
validation that reads ``k`` batches of ``b`` windows on every rank reads windows ``0 .. k W b - 1``
whatever the layout: all ``N`` with torchtitan's default ``[validation] steps = -1`` (``W b`` must
divide ``N``; a multiple of 64 serves every power-of-two layout up to 64 windows a step). Every window has
``seq_len`` scored tokens, so the validator's mean over batches is the mean over windows whatever
``W`` is. torchtitan 0.2.2's own loader instead gives each rank a contiguous share of the
documents and reads each from its start (~45 documents of pysource version 1 at W = 2; another W
read others).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import IterableDataset

from .dataset import Tokenizer

WINDOW_MULTIPLE = 64


class HeldOutTokens:
    """The windows of one held-out set (shared by every rank's dataset: tokenized once)."""

    def __init__(self, documents: Sequence[str], tokenizer: Tokenizer, seq_len: int, name: str = "held-out"):
        ids: list[int] = []
        starts = []  # each document's first token in ``ids``
        for doc in documents:
            starts.append(len(ids))
            ids += tokenizer.encode(doc, add_bos=True, add_eos=True)
        self.name, self.seq_len = name, int(seq_len)
        window = self.seq_len + 1
        self.num_windows = len(ids) // window // WINDOW_MULTIPLE * WINDOW_MULTIPLE
        if self.num_windows == 0:
            raise ValueError(f"{name}: {len(ids)} held-out tokens make fewer than {WINDOW_MULTIPLE} windows of "
                             f"seq_len + 1 = {window} tokens; use a shorter [validation] seq_len")
        self.tokens = torch.tensor(ids[:self.num_windows * window], dtype=torch.long).view(self.num_windows, window)
        self.document_starts = [s for s in starts if s < self.tokens.numel()]

    @property
    def scored_tokens(self) -> int:
        return self.num_windows * self.seq_len

    def document_token_counts(self) -> list[int]:
        """Tokens of each document that the windows hold, in corpus order."""
        ends = self.document_starts[1:] + [self.tokens.numel()]
        return [e - s for s, e in zip(self.document_starts, ends)]

    def windows_per_rank(self, dp_world_size: int, batch_size: int, steps: int = -1) -> int:
        return windows_per_rank(self.num_windows, dp_world_size, batch_size, steps, self.name)


def documents_read(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> int:
    """How many of ``documents`` the windows hold (the audit's heldout_documents); 0 where they make
    no window."""
    try:
        return len(HeldOutTokens(documents, tokenizer, seq_len).document_starts)
    except ValueError:
        return 0


def windows_per_rank(num_windows: int, dp_world_size: int, batch_size: int, steps: int = -1,
                     name: str = "held-out") -> int:
    """Windows each rank reads per validation; a layout that cannot read the same windows as every
    other is refused."""
    per_step = dp_world_size * batch_size
    if num_windows % per_step:
        raise ValueError(
            f"{name}: {num_windows} held-out windows do not split into batches of "
            f"{dp_world_size} data-parallel ranks x local_batch_size {batch_size}; use a power-of-two "
            f"product up to {WINDOW_MULTIPLE}")
    total = num_windows // per_step
    if steps != -1 and not 0 < steps <= total:
        raise ValueError(f"{name}: [validation] steps {steps} outside 1..{total} (the whole held-out "
                         f"set at this layout); leave it at -1 to read every window")
    return (total if steps == -1 else steps) * batch_size


class HeldOutWindows(IterableDataset):
    """Rank ``dp_rank`` of ``dp_world_size``'s windows, ``({"input": x[:-1]}, x[1:])`` as torchtitan's
    text datasets yield; each iteration starts at the first, so every validation reads the same."""

    def __init__(self, held_out: HeldOutTokens, dp_rank: int, dp_world_size: int, batch_size: int,
                 steps: int = -1):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_world_size {dp_world_size}")
        self.held_out, self.dp_rank, self.dp_world_size = held_out, dp_rank, dp_world_size
        self.per_rank = held_out.windows_per_rank(dp_world_size, batch_size, steps)

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self):
        for i in range(self.per_rank):
            x = self.held_out.tokens[self.dp_rank + i * self.dp_world_size]
            yield {"input": x[:-1]}, x[1:]
