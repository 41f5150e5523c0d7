"""Build-once cache of the corpus and tokenizer (the `hf_assets_path` directory).

torchrun starts many ranks that may all call ensure_assets() at once, so:
- a file lock (fcntl) lets one process build while the others wait;
- every file is written to a temporary name and os.replace()d into place, and
  manifest.json is written last: a directory with a manifest is complete;
- the build is deterministic, so even without the lock two builders would write
  identical bytes and a reader can never see a mix of two versions.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .corpus import CORPUS_VERSION, build_corpus
from .tokenizer import VOCAB_SIZE, tokenizer_files, train_tokenizer

CORPUS_FILE = "corpus.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".build.lock"


def default_assets_dir() -> str:
    """$FLEXDEMO_CACHE or ~/.cache/flexdemo, one subdirectory per Python version.

    The stdlib differs between Python releases, so each version gets its own build.
    """
    root = os.environ.get("FLEXDEMO_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flexdemo"
    )
    tag = f"stdlib-v{CORPUS_VERSION}-py{platform.python_version()}-vocab{VOCAB_SIZE}"
    return os.path.join(root, tag)


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def read_manifest(path: str | os.PathLike) -> dict:
    with open(os.path.join(path, MANIFEST_FILE), "r", encoding="utf-8") as f:
        return json.load(f)


def load_corpus(path: str | os.PathLike) -> dict[str, list[str]]:
    """The {'train': [...], 'validation': [...]} documents stored in an assets dir."""
    with open(os.path.join(path, CORPUS_FILE), "r", encoding="utf-8") as f:
        data = json.load(f)
    return {"train": data["train"], "validation": data["validation"]}


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp makes 0600; caches may be shared
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX within one filesystem
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def _build_lock(path: Path):
    with open(path / LOCK_FILE, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks until the builder is done
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build(path: Path, vocab_size: int) -> None:
    start = time.perf_counter()
    corpus = build_corpus()
    corpus_bytes = json.dumps(
        {"version": CORPUS_VERSION, **corpus}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    tok = train_tokenizer(corpus["train"], vocab_size=vocab_size)
    files = {CORPUS_FILE: corpus_bytes, **tokenizer_files(tok)}
    for name, data in files.items():
        _write_atomic(path / name, data)
    manifest = {
        "corpus_version": CORPUS_VERSION,
        "python_version": platform.python_version(),
        "vocab_size": tok.get_vocab_size(),
        "num_documents": {k: len(v) for k, v in corpus.items()},
        "num_chars": {k: sum(map(len, v)) for k, v in corpus.items()},
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    _write_atomic(path / MANIFEST_FILE, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def ensure_assets(dir: str | os.PathLike | None = None, vocab_size: int = VOCAB_SIZE) -> str:
    """Build corpus + tokenizer into `dir` (default: default_assets_dir()) unless present.

    Returns the directory, ready for `[model] hf_assets_path` and as the dataset
    path. Safe to call from many processes at once.
    """
    path = Path(dir if dir is not None else default_assets_dir()).expanduser().absolute()
    if not is_complete(path):
        path.mkdir(parents=True, exist_ok=True)
        with _build_lock(path):
            if not is_complete(path):  # another process may have built it meanwhile
                _build(path, vocab_size)
    built = read_manifest(path)["vocab_size"]
    if built != vocab_size:
        raise ValueError(f"{path} holds a tokenizer with vocab {built}, asked for {vocab_size}")
    return str(path)
