"""A larger offline corpus: the source code of every installed Python package and of the
standard library, built on the machine that trains (no download).

Files with a source suffix under the standard library and every site-packages directory,
between MIN_CHARS and MAX_CHARS characters (tiny stubs and huge generated tables are left
out), each one document. Identical contents count once (the same module installed twice,
vendored copies), and documents are ordered and split by the sha256 of their text, so the
bytes depend only on what is installed, not on paths, walk order or locale: the same
environment always gives the same corpus. One document in VALIDATION_EVERY, by that hash,
is held out for validation; no text is in both splits (near-duplicates, e.g. two versions
of one module, can still land on both sides).
"""

from __future__ import annotations

import hashlib
import os
import platform
import site
import sysconfig
from pathlib import Path

# Bump when the selection rules change, so old caches are not reused.
PYSOURCE_VERSION = 1
SOURCE_SUFFIXES = (".py", ".pyi", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
MIN_CHARS = 2000
MAX_CHARS = 1_000_000
VALIDATION_EVERY = 100
_SKIP_DIRS = {"__pycache__", ".git", "node_modules"}


def source_roots() -> list[Path]:
    """The standard library and every site-packages directory, none inside another."""
    paths = sysconfig.get_paths()
    candidates = {paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()}
    user = site.getusersitepackages()
    if isinstance(user, str):
        candidates.add(user)
    roots = sorted({Path(p).resolve() for p in candidates if p and os.path.isdir(p)})
    # A site-packages inside the stdlib directory is walked as part of it.
    return [r for r in roots if not any(o != r and o in r.parents for o in roots)]


def environment_fingerprint() -> str:
    """Changes whenever a distribution installed in the source roots (or Python itself) changes: the
    cache key. Read from the roots' ``NAME-VERSION.dist-info`` / ``.egg-info`` entry names, not from
    each distribution's metadata file, which took 0.6 s per call with ~230 installed."""
    roots = source_roots()
    installed = sorted(name for root in roots for name in os.listdir(root)
                       if name.endswith((".dist-info", ".egg-info")))
    text = "\n".join([platform.python_version(), *map(str, roots), *installed])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _source_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(SOURCE_SUFFIXES):
                yield Path(dirpath, name)


def _read_text(path: Path) -> str | None:
    try:
        size = path.stat().st_size
        if size < MIN_CHARS or size > 4 * MAX_CHARS:  # bytes bound the characters from both sides
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # unreadable or not UTF-8 text: not part of the corpus
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text if MIN_CHARS <= len(text) <= MAX_CHARS else None


def build_pysource_corpus(roots: list[Path] | None = None) -> dict[str, list[str]]:
    """``{'train': [...], 'validation': [...]}``: deduplicated, ordered by content hash."""
    roots = source_roots() if roots is None else [Path(r) for r in roots]
    by_digest: dict[bytes, str] = {}
    for root in roots:
        for path in _source_files(root):
            text = _read_text(path)
            if text is not None:
                by_digest.setdefault(hashlib.sha256(text.encode("utf-8")).digest(), text)
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for digest in sorted(by_digest):
        held_out = int.from_bytes(digest[:8], "big") % VALIDATION_EVERY == 0
        splits["validation" if held_out else "train"].append(by_digest[digest])
    if not splits["train"] or not splits["validation"]:
        raise RuntimeError(f"pysource corpus came out empty under {roots}: {len(by_digest)} files")
    return splits
