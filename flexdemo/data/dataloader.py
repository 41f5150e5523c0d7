"""torchtitan 0.2.2 builders for flexdemo's offline corpora.

`build_dataloader` has the TrainSpec.build_dataloader_fn signature. For
`[training] dataset = "flexdemo_stdlib"` or `"flexdemo_pysource"` it serves our corpus;
any other name goes to torchtitan's own build_text_dataloader, so c4 etc. keep working.
`build_tokenizer` is a TrainSpec.build_tokenizer_fn: torchtitan's HF tokenizer from the
config's `[model] hf_assets_path`; only where that holds no tokenizer and the config asks
for an embedded dataset (or names no path) does it use flexdemo's, saying so in one line.

A checkpointed position in flexdemo's corpora survives a change of the data-parallel world
size (the number of ranks torchtitan's dataloader is built for: replicas x shards), which
torchtitan's own ParallelAwareDataloader refuses (an assertion when the world shrinks, a missing
DCP key when it grows): see :func:`reshard_dataset_states` for the rule.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
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

    Rank r of W owns documents r, r+W, r+2W, ... (disjoint, balanced), read in a fresh order
    each epoch. Each document is encoded with BOS/EOS, appended to a buffer and cut into
    ({"input": x[:-1]}, x[1:]) samples. The state (epoch, document index, buffer, and the
    documents handed over by a resharding, read first) is all a resume needs to continue
    bit-exactly.
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
            order = _doc_order(len(self._docs), self._seed, self._epoch)
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
    order = _doc_order(len(own), seed, int(state["epoch"]))
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


def _dataset_state(loader_state: dict[str, Any]) -> dict[str, Any]:
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


class ReshardingDataloader(ParallelAwareDataloader):
    """torchtitan's ParallelAwareDataloader over a :class:`StdlibTextDataset`, whose checkpointed
    position also loads where the data-parallel world size changed since the save.

    ``saved_world_size``: the number of data-parallel ranks of the checkpoint that torchtitan is
    about to load (None: nothing to load, or the same number). Until that load, ``state_dict()``
    asks DCP for every saved rank's state; ``load_state_dict`` then gives this rank its share by
    :func:`reshard_dataset_states`. Saved on the same world size, it is torchtitan's own."""

    def __init__(self, dataset: StdlibTextDataset, dp_rank: int, dp_world_size: int,
                 saved_world_size: int | None = None, **kwargs):
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, **kwargs)
        self._reshard_from = saved_world_size if saved_world_size not in (None, dp_world_size) else None

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
        states = [_dataset_state(pickle.loads(state_dict[f"dp_rank_{r}"])) for r in range(saved)]
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


def saved_world_size_to_reshard(job_config: JobConfig) -> int | None:
    """The data-parallel world size of the dataloader states torchtitan will load at start, or
    None (nothing to load, or the dataloader excluded from loading)."""
    from flexdemo.titan.checkpoint_format import checkpoint_to_resume, saved_keys

    if "dataloader" in (job_config.checkpoint.exclude_from_loading or []):
        return None
    path = checkpoint_to_resume(job_config)
    if path is None:
        return None
    return saved_data_parallel_ranks(saved_keys(path)) or None


def is_embedded_dataset(name: str | None) -> bool:
    """One of flexdemo's corpora (whose checkpointed position reshards), not torchtitan's."""
    return bool(name) and name.lower() in _SPLITS


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
    return ReshardingDataloader(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                                saved_world_size=saved_world_size_to_reshard(job_config), **kwargs)


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
