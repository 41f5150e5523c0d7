"""`python -m flexdemo.data [--corpus stdlib|pysource|pysource2] --out DIR`: build a corpus + the
tokenizer once, before torchrun, and print the directory to use as `[model] hf_assets_path`
(or `[training] dataset_path`).

`python -m flexdemo.data audit [--corpus NAME] [--config TOML] [--dp W]`: one line saying what the
corpus's held-out set measures as the validator reads it (flexdemo.data.audit)."""

import argparse
import json
import sys
import time

from .assets import CORPORA, ensure_assets, read_manifest
from .tokenizer import VOCAB_SIZE


def build(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexdemo.data", description=__doc__)
    parser.add_argument("--corpus", default="stdlib", choices=CORPORA)
    parser.add_argument("--out", default=None, help="assets directory (default: under $FLEXDEMO_CACHE or ~/.cache/flexdemo)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--verbose", action="store_true", help="also print the manifest to stderr")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_assets(args.out, vocab_size=args.vocab_size, corpus=args.corpus)
    if args.verbose:
        print(json.dumps(read_manifest(path), indent=2), file=sys.stderr)
        print(f"ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)  # stdout carries only the path, for shell scripts: DIR=$(python -m flexdemo.data)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["audit"]:
        from .audit_cli import main as audit

        return audit(argv[1:])
    return build(argv)


if __name__ == "__main__":
    sys.exit(main())
