"""Build-once cache of a corpus and the tokenizer (the `hf_assets_path` directory).

Two corpora, one tokenizer: "stdlib" (the standard library's sources, ~2 M tokens; the
byte-level BPE is trained on it) and "pysource" (every installed package's source code,
tens of millions of tokens; its directory carries a copy of the same tokenizer).

torchrun starts many ranks that may all call ensure_assets() at once, so:
- a file lock (fcntl) lets one process build while the others wait;
- every file is written to a temporary name and os.replace()d into place, and
  manifest.json is written last: a directory with a manifest is complete;
- the build is deterministic, so even without the lock two builders would write
  identical bytes and a reader can never see a mix of two versions.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from .corpus import CORPUS_VERSION, build_corpus
from .pysource import PYSOURCE_VERSION, build_pysource_corpus, environment_fingerprint
from .pysource2 import HELDOUT_SEQ_LEN, PYSOURCE2_VERSION, build_pysource2_corpus
from .tokenizer import VOCAB_SIZE, FileTokenizer, tokenizer_files, train_tokenizer

CORPUS_FILE = "corpus.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".build.lock"
CORPORA = ("stdlib", "pysource", "pysource2")
# corpus -> (rules version, builder)
_BUILDERS = {
    "stdlib": (CORPUS_VERSION, build_corpus),
    "pysource": (PYSOURCE_VERSION, build_pysource_corpus),
    "pysource2": (PYSOURCE2_VERSION, build_pysource2_corpus),
}
# Tokens are estimated from every SAMPLE_EVERY-th document (tokenizing all of pysource
# takes minutes on 2 cores); the estimate is within ~1% of the count.
SAMPLE_EVERY = 50


def default_assets_dir(corpus: str = "stdlib", vocab_size: int = VOCAB_SIZE) -> str:
    """$FLEXDEMO_CACHE or ~/.cache/flexdemo, one subdirectory per corpus and source.

    The stdlib differs between Python releases, and pysource with every installed package,
    so each gets its own build (keyed by the Python version / the environment's fingerprint).
    """
    root = os.environ.get("FLEXDEMO_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flexdemo"
    )
    if corpus == "stdlib":
        tag = f"stdlib-v{CORPUS_VERSION}-py{platform.python_version()}-vocab{vocab_size}"
    elif corpus in _BUILDERS:
        tag = f"{corpus}-v{_BUILDERS[corpus][0]}-{environment_fingerprint()}-vocab{vocab_size}"
    else:
        raise ValueError(f"unknown corpus {corpus!r}; expected one of {CORPORA}")
    return os.path.join(root, tag)


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def read_manifest(path: str | os.PathLike) -> dict:
    with open(os.path.join(path, MANIFEST_FILE), "r", encoding="utf-8") as f:
        return json.load(f)


def corpus_sha256(path: str | os.PathLike) -> str:
    """The first 16 hex digits of the sha256 of the corpus file (both splits' documents), as the
    manifest records it: runs whose logs name the same one trained on the same documents."""
    return read_manifest(path)["sha256"][CORPUS_FILE][:16]


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


def estimate_tokens(tok, splits: dict[str, list[str]]) -> dict[str, int]:
    """Tokens per split, from the characters per token of every SAMPLE_EVERY-th document."""
    out = {}
    for name, docs in splits.items():
        sample = docs[::SAMPLE_EVERY]
        sample_tokens = sum(len(e.ids) for e in tok.encode_batch(sample))
        out[name] = round(sum(map(len, docs)) * sample_tokens / max(1, sum(map(len, sample))))
    return out


def _tokenizer(corpus: str, vocab_size: int, splits: dict[str, list[str]] | None):
    """(tokenizer, its files): trained on the stdlib corpus, which pysource shares."""
    from tokenizers import Tokenizer

    if corpus == "stdlib":
        tok = train_tokenizer(splits["train"], vocab_size=vocab_size)
        return tok, tokenizer_files(tok)
    stdlib = Path(ensure_assets(None, vocab_size, "stdlib"))
    files = {name: (stdlib / name).read_bytes() for name in tokenizer_files(Tokenizer.from_str(
        (stdlib / "tokenizer.json").read_text(encoding="utf-8")))}
    return Tokenizer.from_str(files["tokenizer.json"].decode("utf-8")), files


def _documents_read(tokenizer_dir: str, documents: list[str]) -> int:
    """Held-out documents the validator's windows read at the comparison configs' seq_len, tokenized
    as the audit does."""
    from .heldout import documents_read

    return documents_read(documents, FileTokenizer(tokenizer_dir), HELDOUT_SEQ_LEN)


def _build(path: Path, vocab_size: int, corpus: str) -> None:
    start = time.perf_counter()
    version, build = _BUILDERS[corpus]
    splits = None if corpus == "pysource2" else build()
    tok, tok_files = _tokenizer(corpus, vocab_size, splits)
    for name, data in tok_files.items():
        _write_atomic(path / name, data)
    if splits is None:  # counted with stdlib's tokenizer, which these splits do not change
        splits = build(documents_read=functools.partial(_documents_read, str(path)))
    corpus_bytes = json.dumps(
        {"version": version, "corpus": corpus, **splits}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    _write_atomic(path / CORPUS_FILE, corpus_bytes)
    files = {CORPUS_FILE: corpus_bytes, **tok_files}
    manifest = {
        "corpus": corpus,
        "corpus_version": version,
        "python_version": platform.python_version(),
        "vocab_size": tok.get_vocab_size(),
        "num_documents": {k: len(v) for k, v in splits.items()},
        "num_chars": {k: sum(map(len, v)) for k, v in splits.items()},
        "estimated_tokens": estimate_tokens(tok, splits),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    _write_atomic(path / MANIFEST_FILE, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def ensure_assets(dir: str | os.PathLike | None = None, vocab_size: int = VOCAB_SIZE, corpus: str = "stdlib") -> str:
    """Build ``corpus`` + tokenizer into `dir` (default: default_assets_dir(corpus)) unless present.

    Returns the directory, ready for `[model] hf_assets_path` and as the dataset
    path. Safe to call from many processes at once.
    """
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; expected one of {CORPORA}")
    path = Path(dir if dir is not None else default_assets_dir(corpus, vocab_size)).expanduser().absolute()
    if not is_complete(path):
        path.mkdir(parents=True, exist_ok=True)
        with _build_lock(path):
            if not is_complete(path):  # another process may have built it meanwhile
                _build(path, vocab_size, corpus)
    manifest = read_manifest(path)
    if manifest.get("corpus", "stdlib") != corpus:
        raise ValueError(f"{path} holds the {manifest['corpus']!r} corpus, asked for {corpus!r}")
    if manifest["vocab_size"] != vocab_size:
        raise ValueError(f"{path} holds a tokenizer with vocab {manifest['vocab_size']}, asked for {vocab_size}")
    return str(path)
