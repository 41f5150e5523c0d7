"""The validator's loader for flexdemo's held-out splits on torchtitan 0.3.0 (0.2.2:
flexdemo.titan.heldout): the fixed windows of flexdemo.data.heldout, so every layout and seed
scores the same tokens. 0.3.0's Validator builds its loader afresh at every validation, so each
one reads the same windows (what 0.2.2's ``validation_same_batches`` rewinds for). 0.3.0's
Validator passes the training's seq_len and local batch size; ``[validation] seq_len /
local_batch_size`` (0.2.2's keys) are this Config's ``validation_*`` fields, used instead where set (without pipeline
parallelism the Validator uses them for nothing but its loader)."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.tools.logging import logger

from flexdemo.data.assets import ensure_assets, load_corpus
from flexdemo.data.audit import gathered_digest
from flexdemo.data.dataset import SPLITS
from flexdemo.data.heldout import HeldOutTokens, HeldOutWindows


class HeldOutLoader(ParallelAwareDataloader):
    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "flexdemo_stdlib_validation"
        dataset_path: str = ""
        steps: int = -1
        """Batches per rank and validation (-1: the whole set), as [validation] steps."""
        infinite: bool = False  # set by torchtitan's Validator; the windows are read once either way
        # not named seq_len / local_batch_size: 0.3.0's Configurable.build refuses a field of that
        # name beside the Validator's build kwargs of that name (every validation failed with it)
        validation_seq_len: int = 0
        """Validation's sequence length when it differs from the training's (0: the training's)."""
        validation_local_batch_size: int = 0
        """Validation's local batch size when it differs from the training's (0: the training's)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, **_) -> None:
        seq_len = config.validation_seq_len or seq_len
        local_batch_size = config.validation_local_batch_size or local_batch_size
        name = config.dataset.lower()
        corpus, split = SPLITS[name]
        documents = load_corpus(ensure_assets(config.dataset_path or None, corpus=corpus))[split]
        held_out = HeldOutTokens(documents, tokenizer, seq_len, name=name)
        dataset = HeldOutWindows(held_out, dp_rank, dp_world_size, local_batch_size, config.steps)
        if not dist.is_initialized() or dist.get_rank() == 0:
            read = dataset.per_rank * dp_world_size
            digest = gathered_digest(held_out, dp_world_size, local_batch_size, config.steps)  # as the audit's
            logger.info(f"{name}: {held_out.num_windows} windows of {seq_len} + 1 tokens; each validation "
                        f"scores windows 0..{read - 1} over {dp_world_size} data ranks; heldout_digest={digest}")
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size)
