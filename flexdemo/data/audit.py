"""``python -m flexdemo.data audit``: what a held-out set measures, in one line.

    heldout_documents=N heldout_tokens=N max_document_share=F verbatim_line_overlap=F heldout_digest=HEX

* ``heldout_documents``: documents the held-out windows hold (flexdemo.data.heldout);
* ``heldout_tokens``: tokens one validation scores at this layout (windows read x seq_len);
* ``max_document_share``: the largest share of the windows' tokens that one document holds;
* ``verbatim_line_overlap``: characters of the held-out documents' lines of >= 40 characters
  (stripped) that occur verbatim (stripped) in the training split, over all characters of such
  lines: how much of what is scored could be recalled rather than predicted;
* ``heldout_digest``: sha256 of the windows one validation reads, gathered from every rank's
  dataset at this data-parallel size and put back in window order: equal at every layout.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.utils.data import DataLoader

from .heldout import WINDOW_MULTIPLE, HeldOutTokens, HeldOutWindows, windows_per_rank
from .pysource2 import long_lines


@dataclass(frozen=True)
class Audit:
    heldout_documents: int
    heldout_tokens: int
    max_document_share: float
    verbatim_line_overlap: float
    heldout_digest: str

    def line(self) -> str:
        return (f"heldout_documents={self.heldout_documents} heldout_tokens={self.heldout_tokens} "
                f"max_document_share={self.max_document_share:.4f} "
                f"verbatim_line_overlap={self.verbatim_line_overlap:.4f} heldout_digest={self.heldout_digest}")


def verbatim_line_overlap(held_out: Sequence[str], train: Sequence[str]) -> float:
    """Characters of held-out long lines found verbatim in training / characters of held-out long lines."""
    seen = {line for text in train for line in long_lines(text)}
    found = total = 0
    for text in held_out:
        for line in long_lines(text):
            total += len(line)
            found += len(line) if line in seen else 0
    return found / total if total else 0.0


def gathered_digest(held_out: HeldOutTokens, dp_world_size: int, batch_size: int, steps: int = -1) -> str:
    """sha256 of the windows every rank's loader yields at ``dp_world_size``, back in window order."""
    per_rank = []
    for rank in range(dp_world_size):
        loader = DataLoader(HeldOutWindows(held_out, rank, dp_world_size, batch_size, steps), batch_size=batch_size)
        per_rank.append(torch.cat([torch.cat([x["input"], y[:, -1:]], dim=1) for x, y in loader]))
    windows = torch.stack(per_rank, dim=1).flatten(0, 1)  # window i * W + r = rank r's i-th
    return hashlib.sha256(windows.to(torch.int32).numpy().tobytes()).hexdigest()


def audit_split(train: Sequence[str], validation: Sequence[str], tokenizer, seq_len: int, dp_world_size: int,
                batch_size: int, steps: int = -1) -> Audit:
    held_out = HeldOutTokens(validation, tokenizer, seq_len)
    read = held_out.windows_per_rank(dp_world_size, batch_size, steps) * dp_world_size
    counts = held_out.document_token_counts()
    return Audit(
        heldout_documents=len(counts),
        heldout_tokens=read * seq_len,
        max_document_share=max(counts) / held_out.tokens.numel(),
        verbatim_line_overlap=verbatim_line_overlap(validation[:len(counts)], train),
        heldout_digest=gathered_digest(held_out, dp_world_size, batch_size, steps),
    )


def check_layout(dataset: str, dataset_path: str | None, tokenizer_dir: str | None, seq_len: int,
                 dp_world_size: int, batch_size: int, steps: int = -1) -> None:
    """ValueError (the held-out set's own message) where a validator of flexdemo's held-out split
    ``dataset`` could not read the same windows at this layout; nothing for other datasets. For the
    launchers' pre-flight, before any rank starts. A layout reading the whole set in batches whose
    size divides 64 splits every set (its window count is a multiple of 64): nothing is read; any
    other loads the corpus (built where missing; ~7 s for pysource2) and tokenizes the split with
    ``tokenizer_dir``'s tokenizer (the corpus's where it holds none), once per process."""
    from .dataset import SPLITS

    if dataset.lower() not in SPLITS:
        return
    if steps == -1 and WINDOW_MULTIPLE % (dp_world_size * batch_size) == 0:
        return
    num = _num_windows(dataset.lower(), dataset_path or None, tokenizer_dir or None, seq_len)
    windows_per_rank(num, dp_world_size, batch_size, steps, dataset.lower())


@functools.lru_cache(maxsize=8)
def _num_windows(dataset: str, dataset_path: str | None, tokenizer_dir: str | None, seq_len: int) -> int:
    from .assets import ensure_assets, load_corpus
    from .dataset import SPLITS
    from .tokenizer import FileTokenizer, has_tokenizer

    corpus, split = SPLITS[dataset]
    assets = ensure_assets(dataset_path, corpus=corpus)
    tokenizer = FileTokenizer(tokenizer_dir if tokenizer_dir and has_tokenizer(tokenizer_dir) else assets)
    return HeldOutTokens(load_corpus(assets)[split], tokenizer, seq_len, name=dataset).num_windows
