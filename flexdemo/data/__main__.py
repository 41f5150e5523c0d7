"""`python -m flexdemo.data --out DIR`: build corpus + tokenizer once, before
torchrun, and print the directory to use as `[model] hf_assets_path`."""

import argparse
import json
import sys
import time

from .assets import default_assets_dir, ensure_assets, read_manifest
from .tokenizer import VOCAB_SIZE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexdemo.data", description=__doc__)
    parser.add_argument("--out", default=None, help=f"assets directory (default {default_assets_dir()})")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    parser.add_argument("--verbose", action="store_true", help="also print the manifest to stderr")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = ensure_assets(args.out, vocab_size=args.vocab_size)
    if args.verbose:
        print(json.dumps(read_manifest(path), indent=2), file=sys.stderr)
        print(f"ready in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    print(path)  # stdout carries only the path, for shell scripts: DIR=$(python -m flexdemo.data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
