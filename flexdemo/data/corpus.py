"""Offline text corpus built from the Python standard library's own source files.

Every machine that runs Python has these files, so training needs no download.
The result depends only on the file contents: a fixed module list read in sorted
order, line endings normalised, and a path-hash train/validation split, so two
builds with the same Python version give the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import sysconfig
from pathlib import Path

# Bump when the selection/splitting rules change, so old caches are not reused.
CORPUS_VERSION = 1

# Packages read in full (minus tests). Prose-heavy, ordinary code; no generated
# tables (encodings), GUI demos or vendored copies (idlelib, lib2to3, site-packages).
PACKAGES = (
    "asyncio",
    "collections",
    "concurrent",
    "email",
    "html",
    "http",
    "importlib",
    "json",
    "logging",
    "tomllib",
    "urllib",
    "wsgiref",
    "xmlrpc",
    "zoneinfo",
)

# Documents shorter than this are merged with the next piece of the same file,
# so a stream is not dominated by BOS/EOS tokens.
MIN_DOC_CHARS = 2000

# One file in VALIDATION_EVERY goes to the validation split (whole files, so
# validation text never overlaps training text).
VALIDATION_EVERY = 20

# PEP 8 puts two blank lines before top-level definitions: a natural cut point.
_TOP_LEVEL_BREAK = re.compile(r"\n\n\n+(?=\S)")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_test_path(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in ("test", "tests") for p in parts[:-1]) or parts[-1].startswith("test_")


def list_source_files(root: Path | None = None) -> list[str]:
    """Relative paths ('json/decoder.py'), sorted, of the files the corpus uses."""
    root = Path(root) if root is not None else stdlib_dir()
    rels = [p.name for p in root.glob("*.py") if p.is_file()]
    for pkg in PACKAGES:
        base = root / pkg
        if not base.is_dir():  # e.g. tomllib before 3.11: skip, don't fail
            continue
        for dirpath, _dirnames, filenames in os.walk(base):
            for name in filenames:
                if name.endswith(".py"):
                    rel = Path(dirpath, name).relative_to(root).as_posix()
                    if not _is_test_path(rel):
                        rels.append(rel)
    # Sorted by code point, not by locale or walk order.
    return sorted(set(rels))


def _is_validation(rel: str) -> bool:
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % VALIDATION_EVERY == 0


def split_into_documents(rel: str, text: str) -> list[str]:
    """Cut one source file at top-level boundaries into documents of >= MIN_DOC_CHARS."""
    docs: list[str] = []
    current = ""
    for piece in _TOP_LEVEL_BREAK.split(text):
        current = f"{current}\n\n\n{piece}" if current else piece
        if len(current) >= MIN_DOC_CHARS:
            docs.append(current)
            current = ""
    if current.strip():
        if docs and len(current) < MIN_DOC_CHARS // 4:
            docs[-1] = f"{docs[-1]}\n\n\n{current}"  # tiny tail: keep with its file
        else:
            docs.append(current)
    # The path header gives the model some context and makes documents distinct.
    return [f"# {rel}\n{d}" for d in docs]


def _read_source(path: Path) -> str:
    # Stdlib sources are UTF-8; 'replace' keeps a stray byte from aborting a run.
    text = path.read_bytes().decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def build_corpus(root: Path | None = None) -> dict[str, list[str]]:
    """Return {'train': [doc, ...], 'validation': [doc, ...]}, deterministic."""
    root = Path(root) if root is not None else stdlib_dir()
    files = list_source_files(root)
    if not files:
        raise FileNotFoundError(f"no Python source files found under {root}")
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for rel in files:
        docs = split_into_documents(rel, _read_source(root / rel))
        splits["validation" if _is_validation(rel) else "train"].extend(docs)
    if not splits["train"] or not splits["validation"]:
        raise RuntimeError(f"corpus split came out empty under {root}: {len(files)} files")
    return splits
