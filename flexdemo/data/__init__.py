"""Offline "embedded default" data for torchtitan: a text corpus built from the
Python standard library's source files and a byte-level BPE trained on it.

Nothing here imports torchtitan: the dataset (flexdemo.data.dataset, torch only), the resharding
of its checkpointed position (flexdemo.data.resharding) and the asset builders. The torchtitan-facing
builders (build_dataloader, build_tokenizer) live in flexdemo.titan.data. This package root
imports only the asset builders, so `python -m flexdemo.data` stays light.
"""

from .assets import default_assets_dir, ensure_assets, load_corpus, read_manifest
from .corpus import build_corpus, list_source_files
from .tokenizer import BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE, train_tokenizer

__all__ = [
    "BOS_TOKEN",
    "EOS_TOKEN",
    "VOCAB_SIZE",
    "build_corpus",
    "default_assets_dir",
    "ensure_assets",
    "list_source_files",
    "load_corpus",
    "read_manifest",
    "train_tokenizer",
]
