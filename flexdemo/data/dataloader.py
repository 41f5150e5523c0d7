"""torchtitan 0.2.2 builders for flexdemo's offline corpora.

`build_dataloader` has the TrainSpec.build_dataloader_fn signature. For
`[training] dataset = "flexdemo_stdlib"` or `"flexdemo_pysource"` it serves our corpus;
any other name goes to torchtitan's own build_text_dataloader, so c4 etc. keep working.
`build_tokenizer` is a TrainSpec.build_tokenizer_fn: torchtitan's HF tokenizer from the
config's `[model] hf_assets_path`; only where that holds no tokenizer and the config asks
for an embedded dataset (or names no path) does it use flexdemo's, saying so in one line.
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
PYSOURCE_DATASET_NAME = "flexdemo_pysource"
PYSOURCE_VALIDATION_DATASET_NAME = "flexdemo_pysource_validation"
# dataset name -> (corpus, split)
_SPLITS = {
    DATASET_NAME: ("stdlib", "train"),
    VALIDATION_DATASET_NAME: ("stdlib", "validation"),
    PYSOURCE_DATASET_NAME: ("pysource", "train"),
    PYSOURCE_VALIDATION_DATASET_NAME: ("pysource", "validation"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# Assets dir per corpus chosen by the last build_dataloader call; torchtitan's validator
# builds its loader later with no path of ours, and should read the same corpus.
_last_assets_dir: dict[str, str] = {}


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


def resolve_assets_dir(job_config: JobConfig, corpus: str) -> str:
    """Where the corpus lives: training.dataset_path, else hf_assets_path if it holds this
    corpus, else the default cache (built on first use)."""
    if job_config.training.dataset_path:
        return ensure_assets(job_config.training.dataset_path, corpus=corpus)
    hf_dir = job_config.model.hf_assets_path
    if hf_dir and os.path.isfile(os.path.join(hf_dir, MANIFEST_FILE)):
        if read_manifest(hf_dir).get("corpus", "stdlib") == corpus:
            return os.path.abspath(hf_dir)
    return ensure_assets(corpus=corpus)


def has_tokenizer(path: str) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def embedded_corpus(job_config: JobConfig) -> str | None:
    """The flexdemo corpus the config trains (or validates) on, or None for other datasets."""
    names = [job_config.training.dataset]
    if job_config.validation.enable:
        names.append(job_config.validation.dataset)
    for name in names:
        if name and name.lower() in _SPLITS:
            return _SPLITS[name.lower()][0]
    return None


def embedded_tokenizer_dir(job_config: JobConfig, build_dir: str | None = None) -> tuple[str | None, str | None]:
    """Where the tokenizer comes from when the config's own cannot serve:
    ``(flexdemo assets dir to use as hf_assets_path, the one line that says so)``, or
    ``(None, None)``: the config's hf_assets_path stays as it is. flexdemo's tokenizer is
    used only where that path holds none and the config asks for an embedded dataset or
    names no path at all; a config's own tokenizer is never replaced."""
    path = job_config.model.hf_assets_path
    corpus = embedded_corpus(job_config)
    if has_tokenizer(path) or (corpus is None and path):
        return None, None
    assets = ensure_assets(build_dir, corpus=corpus or "stdlib")
    return assets, (
        f"flexdemo: [model] hf_assets_path {path!r} holds no tokenizer; using flexdemo's embedded "
        f"tokenizer from {assets}"
    )


def check_tokenizer_available(job_config: JobConfig) -> None:
    """A dataset of torchtitan's own needs the config's tokenizer: say so before any rank starts."""
    path = job_config.model.hf_assets_path
    if path and embedded_corpus(job_config) is None and not has_tokenizer(path):
        raise FileNotFoundError(
            f"[model] hf_assets_path {path!r} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}), "
            f"which dataset {job_config.training.dataset!r} needs"
        )


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
    name = job_config.training.dataset.lower()
    if name not in _SPLITS:
        return tt_text.build_text_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    corpus, split = _SPLITS[name]
    assets_dir = resolve_assets_dir(job_config, corpus)
    _last_assets_dir[corpus] = assets_dir
    _check_same_data_on_all_ranks(assets_dir, tokenizer)
    documents = load_corpus(assets_dir)[split]
    tokens = read_manifest(assets_dir).get("estimated_tokens", {}).get(split)
    size = f", ~{tokens / 1e6:.1f} M tokens" if tokens else ""
    logger.info(f"{name}: {len(documents)} documents{size} from {assets_dir}, dp {dp_rank}/{dp_world_size}")
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
    """TrainSpec.build_tokenizer_fn: torchtitan's HF tokenizer from ``hf_assets_path``, or
    flexdemo's where :func:`embedded_tokenizer_dir` says so (logged in one line)."""
    assets, reason = embedded_tokenizer_dir(job_config)
    if assets is not None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning(reason)
        job_config.model.hf_assets_path = assets
    tokenizer = build_hf_tokenizer(job_config)
    logger.info(f"tokenizer: {job_config.model.hf_assets_path} ({tokenizer.get_vocab_size()} ids)")
    return tokenizer


def _hf_loader(corpus: str, split: str):
    """Loader for torchtitan's DATASETS registry (used by its validator)."""

    def load(path: str):
        from datasets import Dataset  # torchtitan's dependency; imported lazily

        if path:
            assets_dir = ensure_assets(path, corpus=corpus)
        else:
            assets_dir = _last_assets_dir.get(corpus) or ensure_assets(corpus=corpus)
        return Dataset.from_dict({"text": load_corpus(assets_dir)[split]})

    return load


def register_torchtitan_datasets() -> None:
    """Add our splits to torchtitan's dataset registry, so `[validation] dataset =
    "flexdemo_stdlib_validation"` works with torchtitan's own validator. Idempotent."""
    for name, (corpus, split) in _SPLITS.items():
        tt_text.DATASETS.setdefault(
            name,
            DatasetConfig(path="", loader=_hf_loader(corpus, split), sample_processor=lambda s: s["text"]),
        )


register_torchtitan_datasets()
