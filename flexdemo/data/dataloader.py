"""torchtitan 0.2.2 builders for the offline stdlib corpus.

`build_dataloader` has the TrainSpec.build_dataloader_fn signature. For
`[training] dataset = "flexdemo_stdlib"` it serves our corpus; any other name
goes to torchtitan's own build_text_dataloader, so c4 etc. keep working.
`build_tokenizer` is a TrainSpec.build_tokenizer_fn that builds the assets
first when `[model] hf_assets_path` is empty or not built yet.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer, build_hf_tokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as tt_text
from torchtitan.tools.logging import logger

from .assets import MANIFEST_FILE, ensure_assets, load_corpus, read_manifest

DATASET_NAME = "flexdemo_stdlib"
VALIDATION_DATASET_NAME = "flexdemo_stdlib_validation"
_SPLITS = {DATASET_NAME: "train", VALIDATION_DATASET_NAME: "validation"}

# Assets dir chosen by the last build_dataloader call; torchtitan's validator
# builds its loader later with no path of ours, and should read the same corpus.
_last_assets_dir: str | None = None


def _doc_order(num_docs: int, seed: int, epoch: int) -> list[int]:
    """A fresh document order per epoch, from sha256 only (same on every Python/OS)."""
    key = f"{seed}:{epoch}:".encode()
    return sorted(range(num_docs), key=lambda i: hashlib.sha256(key + str(i).encode()).digest())


class StdlibTextDataset(IterableDataset, Stateful):
    """Token stream of seq_len+1 windows, same contract as torchtitan's HuggingFaceTextDataset.

    Rank r of W owns documents r, r+W, r+2W, ... (disjoint, balanced). Each
    document is encoded with BOS/EOS, appended to a buffer and cut into
    ({"input": x[:-1]}, x[1:]) samples. The state (epoch, document index, buffer)
    is all a resume needs to continue bit-exactly.
    """

    def __init__(
        self,
        documents: Sequence[str],
        tokenizer: BaseTokenizer,
        seq_len: int = 2048,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = False,
        seed: int = 0,
        name: str = DATASET_NAME,
    ) -> None:
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} outside dp_world_size {dp_world_size}")
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

    def __iter__(self):
        window = self.seq_len + 1
        while True:
            order = _doc_order(len(self._docs), self._seed, self._epoch)
            while self._sample_idx < len(order):
                text = self._docs[order[self._sample_idx]]
                self._token_buffer.extend(self._tokenizer.encode(text, add_bos=True, add_eos=True))
                self._sample_idx += 1
                while len(self._token_buffer) >= window:
                    x = torch.LongTensor(self._token_buffer[:window])
                    self._token_buffer = self._token_buffer[window:]
                    yield {"input": x[:-1]}, x[1:]
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
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._epoch = int(state_dict["epoch"])
        self._sample_idx = int(state_dict["sample_idx"])
        self._token_buffer = list(state_dict["token_buffer"])


def resolve_assets_dir(job_config: JobConfig) -> str:
    """Where the corpus lives: training.dataset_path, else hf_assets_path if it is
    one of our asset dirs, else the default cache (built on first use)."""
    if job_config.training.dataset_path:
        return ensure_assets(job_config.training.dataset_path)
    hf_dir = job_config.model.hf_assets_path
    if hf_dir and os.path.isfile(os.path.join(hf_dir, MANIFEST_FILE)):
        return os.path.abspath(hf_dir)
    return ensure_assets()


def _check_same_data_on_all_ranks(assets_dir: str, tokenizer: BaseTokenizer) -> None:
    """Fail fast if ranks (e.g. nodes with different Python builds) would read
    different corpora or tokenize differently; silent mismatch would poison training."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    probe = "def f(x):\n    return {'ä': x}  # probe\n"
    mine = (read_manifest(assets_dir)["sha256"]["corpus.json"], tuple(tokenizer.encode(probe)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        raise RuntimeError(
            f"{DATASET_NAME}: ranks disagree on corpus or tokenizer; build the assets once "
            "(python -m flexdemo.data --out DIR) and point every node at the same files"
        )


def build_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """TrainSpec.build_dataloader_fn: our corpus for flexdemo_stdlib*, torchtitan's otherwise."""
    global _last_assets_dir
    name = job_config.training.dataset.lower()
    if name not in _SPLITS:
        return tt_text.build_text_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    assets_dir = resolve_assets_dir(job_config)
    _last_assets_dir = assets_dir
    _check_same_data_on_all_ranks(assets_dir, tokenizer)
    documents = load_corpus(assets_dir)[_SPLITS[name]]
    logger.info(f"{name}: {len(documents)} documents from {assets_dir}, dp {dp_rank}/{dp_world_size}")
    dataset = StdlibTextDataset(
        documents,
        tokenizer,
        seq_len=job_config.training.seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        seed=job_config.debug.seed or 0,  # None by default in 0.2.2
        name=name,
    )
    kwargs = {**asdict(job_config.training.dataloader), "batch_size": job_config.training.local_batch_size}
    if kwargs.get("num_workers", 0) > 1:
        # Every worker would replay the same stream: duplicate samples, not more speed.
        raise ValueError(f"{name} supports training.dataloader.num_workers 0 or 1")
    return ParallelAwareDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)


def build_tokenizer(job_config: JobConfig) -> BaseTokenizer:
    """TrainSpec.build_tokenizer_fn: torchtitan's HF tokenizer, assets built on demand.

    An empty hf_assets_path means the default cache dir (and is rewritten to it);
    a path without tokenizer.json gets our assets built there (ranks wait on a lock).
    """
    path = job_config.model.hf_assets_path
    if not path:
        job_config.model.hf_assets_path = ensure_assets()
    elif not os.path.isfile(os.path.join(path, "tokenizer.json")):
        ensure_assets(path)
    return build_hf_tokenizer(job_config)


def _hf_loader(split: str):
    """Loader for torchtitan's DATASETS registry (used by its validator)."""

    def load(path: str):
        from datasets import Dataset  # torchtitan's dependency; imported lazily

        assets_dir = ensure_assets(path) if path else (_last_assets_dir or ensure_assets())
        return Dataset.from_dict({"text": load_corpus(assets_dir)[split]})

    return load


def register_torchtitan_datasets() -> None:
    """Add our splits to torchtitan's dataset registry, so `[validation] dataset =
    "flexdemo_stdlib_validation"` works with torchtitan's own validator. Idempotent."""
    for name, split in _SPLITS.items():
        tt_text.DATASETS.setdefault(
            name,
            DatasetConfig(path="", loader=_hf_loader(split), sample_processor=lambda s: s["text"]),
        )


register_torchtitan_datasets()
