"""Fail fast where the ranks of one job would train on different data: another corpus build (nodes
with other Python builds or packages) or a tokenizer that encodes differently. A silent mismatch
would poison training; both torchtitan adapters' loaders call this before reading."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .assets import corpus_sha256

PROBE = "def f(x):\n    return {'ä': x}  # probe\n"


def check_same_data_on_all_ranks(assets_dir: str, tokenizer, name: str) -> None:
    """RuntimeError on every rank where any two ranks' corpus sha256 or probe encoding differ."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = (corpus_sha256(assets_dir), tuple(tokenizer.encode(PROBE)))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        raise RuntimeError(
            f"{name}: ranks disagree on corpus or tokenizer; build the assets once "
            "(python -m flexdemo.data --out DIR) and point every node at the same files"
        )
