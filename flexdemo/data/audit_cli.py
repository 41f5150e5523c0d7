"""The arguments of `python -m flexdemo.data audit`: the held-out set and layout a config's
validator reads (or the comparison configs' defaults), then flexdemo.data.audit's line."""

from __future__ import annotations

import argparse
import os
import sys

from .assets import CORPORA, ensure_assets, load_corpus
from .audit import audit_split
from .dataset import SPLITS
from .pysource2 import HELDOUT_SEQ_LEN
from .tokenizer import FileTokenizer, has_tokenizer

# torchtitan 0.2.2's [validation] defaults, and the comparison configs' layout where no config is named.
DEFAULTS = {"seq_len": HELDOUT_SEQ_LEN, "local_batch_size": 8, "steps": -1}


def _read_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def layout_from_config(path: str, dp: int | None) -> dict:
    """corpus, assets dir, tokenizer dir, seq_len, local batch, steps and data-parallel size that
    the config's validator uses."""
    cfg = _read_toml(path)
    val, par = cfg.get("validation", {}), cfg.get("parallelism", {})
    name = str(val.get("dataset", "")).lower()
    if name not in SPLITS:
        raise SystemExit(f"{path}: [validation] dataset {val.get('dataset')!r} is not one of flexdemo's "
                         f"held-out splits ({', '.join(n for n in SPLITS if n.endswith('_validation'))})")
    if dp is None:
        replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
        if shard < 1:
            raise SystemExit(f"{path}: data_parallel_shard_degree {shard} depends on the world size; pass --dp W")
        dp = replicate * shard
    hf = cfg.get("model", {}).get("hf_assets_path", "")
    return {"corpus": SPLITS[name][0], "assets": val.get("dataset_path") or None, "dp": dp,
            "tokenizer": hf if has_tokenizer(hf) else None,
            **{k: int(val.get(k, 2048 if k == "seq_len" else DEFAULTS[k])) for k in DEFAULTS}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexdemo.data audit",
                                     description="What a held-out set measures, in one line.")
    parser.add_argument("--corpus", choices=CORPORA, default=None, help="default: pysource2, or the config's")
    parser.add_argument("--config", default=None, help="a train config: its validator's dataset, seq_len, batch, steps, layout")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: the config's, else 1)")
    parser.add_argument("--out", default=None, help="the corpus's assets directory (default: the cache)")
    args = parser.parse_args(argv)
    if args.dp is not None and args.dp < 1:
        parser.error(f"--dp {args.dp}: must be >= 1")
    if args.config:
        layout = layout_from_config(args.config, args.dp)
        if args.corpus and args.corpus != layout["corpus"]:
            parser.error(f"--corpus {args.corpus} but {args.config} validates on {layout['corpus']}")
    else:
        layout = {"corpus": args.corpus or "pysource2", "assets": None, "tokenizer": None, "dp": args.dp or 1, **DEFAULTS}
    assets = ensure_assets(args.out or layout["assets"], corpus=layout["corpus"])
    splits = load_corpus(assets)
    try:
        result = audit_split(splits["train"], splits["validation"], FileTokenizer(layout["tokenizer"] or assets),
                             layout["seq_len"], layout["dp"], layout["local_batch_size"], layout["steps"])
    except ValueError as e:
        print(f"python -m flexdemo.data audit: {e}", file=sys.stderr)
        return 2
    print(result.line())
    return 0
