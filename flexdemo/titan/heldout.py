"""The validator's loader for flexdemo's held-out splits: the fixed windows of
flexdemo.data.heldout (every layout and seed scores the same tokens) in place of torchtitan 0.2.2's
per-rank contiguous shares of the documents. Other validation datasets keep torchtitan's loader."""

from __future__ import annotations

from typing import Any

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from flexdemo.data.assets import load_corpus
from flexdemo.data.audit import gathered_digest
from flexdemo.data.dataset import SPLITS
from flexdemo.data.heldout import HeldOutTokens, HeldOutWindows

from .data import assets_dir_for_validation


def build_heldout_dataloader(job_config, dp_world_size: int, dp_rank: int, tokenizer: Any) -> ParallelAwareDataloader:
    val = job_config.validation
    name = val.dataset.lower()
    corpus, split = SPLITS[name]
    documents = load_corpus(assets_dir_for_validation(job_config, corpus))[split]
    held_out = HeldOutTokens(documents, tokenizer, val.seq_len, name=name)
    dataset = HeldOutWindows(held_out, dp_rank, dp_world_size, val.local_batch_size, val.steps)
    read = dataset.per_rank * dp_world_size
    # the digest `python -m flexdemo.data audit` prints: runs that log the same one scored the same tokens
    digest = gathered_digest(held_out, dp_world_size, val.local_batch_size, val.steps)
    logger.info(
        f"{name}: {held_out.num_windows} windows of {val.seq_len} + 1 tokens from {len(held_out.document_starts)} "
        f"documents; each validation scores windows 0..{read - 1} ({read * val.seq_len:,} tokens), "
        f"rank {dp_rank} of {dp_world_size} every {dp_world_size}th from window {dp_rank}; heldout_digest={digest}")
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=val.local_batch_size)
