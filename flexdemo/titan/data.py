"""torchtitan 0.2.2 builders for flexdemo's offline corpora (flexdemo.data).

`build_dataloader` is the train specs' TrainSpec.build_dataloader_fn. For
`[training] dataset = "flexdemo_stdlib"` or `"flexdemo_pysource"` it serves our corpus;
any other name goes to torchtitan's own build_text_dataloader, so c4 etc. keep working.
`build_tokenizer` is their TrainSpec.build_tokenizer_fn: torchtitan's HF tokenizer from the
config's `[model] hf_assets_path`; only where that holds no tokenizer and the config asks
for an embedded dataset (or names no path) does it use flexdemo's, saying so in one line.
Importing this module registers flexdemo's splits in torchtitan's DATASETS registry (for
its validator).

A checkpointed position in flexdemo's corpora survives a change of the data-parallel world
size (the number of ranks torchtitan's dataloader is built for: replicas x shards), which
torchtitan's own ParallelAwareDataloader refuses (an assertion when the world shrinks, a missing
DCP key when it grows): see flexdemo.data.resharding for the rule.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch.distributed as dist
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer, build_hf_tokenizer
from torchtitan.config import JobConfig
from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets import text_datasets as tt_text
from torchtitan.tools.logging import logger

from flexdemo.data.assets import MANIFEST_FILE, corpus_sha256, ensure_assets, load_corpus, read_manifest
from flexdemo.data.dataset import DATASET_NAME, SPLITS, StdlibTextDataset
from flexdemo.data.same_data import check_same_data_on_all_ranks
from flexdemo.data.tokenizer import TOKENIZER_FILES, has_tokenizer

from . import elastic
from .data_position import ReshardingMixin, saved_world_size_to_reshard  # noqa: F401 (re-exported)

# Assets dir per corpus chosen by the last build_dataloader call; torchtitan's validator
# builds its loader later with no path of ours, and should read the same corpus.
_last_assets_dir: dict[str, str] = {}


class ReshardingDataloader(ReshardingMixin, ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader over a :class:`StdlibTextDataset`, whose checkpointed
    position also loads where the data-parallel world size changed since the save
    (flexdemo.titan.data_position, shared with the 0.3.0 adapter).

    ``saved_world_size``: the number of data-parallel ranks of the checkpoint that torchtitan is
    about to load (None: nothing to load, or the same number)."""

    def __init__(self, dataset: StdlibTextDataset, dp_rank: int, dp_world_size: int,
                 saved_world_size: int | None = None, **kwargs):
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
        self.reshard_from(saved_world_size)


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


def embedded_corpus(job_config: JobConfig) -> str | None:
    """The flexdemo corpus the config trains (or validates) on, or None for other datasets."""
    names = [job_config.training.dataset]
    if job_config.validation.enable:
        names.append(job_config.validation.dataset)
    for name in names:
        if name and name.lower() in SPLITS:
            return SPLITS[name.lower()][0]
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


def build_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """TrainSpec.build_dataloader_fn: our corpus for flexdemo_stdlib*, torchtitan's otherwise.
    Elastic replicas (separate jobs) each read their own shard of every replica's data."""
    dp_world_size, dp_rank = elastic.data_shard(job_config, dp_world_size, dp_rank)
    name = job_config.training.dataset.lower()
    if name not in SPLITS:
        return tt_text.build_text_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    corpus, split = SPLITS[name]
    assets_dir = resolve_assets_dir(job_config, corpus)
    _last_assets_dir[corpus] = assets_dir
    check_same_data_on_all_ranks(assets_dir, tokenizer, DATASET_NAME)
    documents = load_corpus(assets_dir)[split]
    tokens = read_manifest(assets_dir).get("estimated_tokens", {}).get(split)
    size = f", ~{tokens / 1e6:.1f} M tokens" if tokens else ""
    logger.info(f"{name}: {len(documents)} documents{size} from {assets_dir} "
                f"(corpus_sha256={corpus_sha256(assets_dir)}), dp {dp_rank}/{dp_world_size}")
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
    return ReshardingDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                saved_world_size=saved_world_size_to_reshard(job_config, dp_rank), **kwargs)


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


def _validation_assets(path: str | None, corpus: str) -> str:
    """Where the validator reads ``corpus``: ``path`` ([validation] dataset_path), else the
    directory the training loader chose for it, else the default cache."""
    if path:
        return ensure_assets(path, corpus=corpus)
    return _last_assets_dir.get(corpus) or ensure_assets(corpus=corpus)


def assets_dir_for_validation(job_config: JobConfig, corpus: str) -> str:
    return _validation_assets(job_config.validation.dataset_path, corpus)


def _hf_loader(corpus: str, split: str):
    """Loader for torchtitan's DATASETS registry (used by its validator)."""

    def load(path: str):
        from datasets import Dataset  # torchtitan's dependency; imported lazily

        return Dataset.from_dict({"text": load_corpus(_validation_assets(path, corpus))[split]})

    return load


def register_torchtitan_datasets() -> None:
    """Add our splits to torchtitan's dataset registry, so `[validation] dataset =
    "flexdemo_stdlib_validation"` works with torchtitan's own validator. Idempotent."""
    for name, (corpus, split) in SPLITS.items():
        tt_text.DATASETS.setdefault(
            name,
            DatasetConfig(path="", loader=_hf_loader(corpus, split), sample_processor=lambda s: s["text"]),
        )


register_torchtitan_datasets()
