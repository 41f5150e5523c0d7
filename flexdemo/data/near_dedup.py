"""Near-duplicate clusters of source files: MinHash over 5-token shingles, LSH banding, and a check
of each candidate pair's estimated Jaccard similarity (the rule BigCode used for The Stack).

* Tokens: runs of letters, digits and ``_`` (punctuation and layout are ignored, so a re-indented
  or re-formatted copy still matches). Shingles: every 5 consecutive tokens, as a set.
* Signature: ``NUM_PERM`` minima of ``mix(h xor s_i)`` over the 64-bit shingle hashes ``h``, ``mix``
  splitmix64's finaliser and ``s_i`` fixed random keys, computed with numpy. (``(a h + b) mod p``
  with 32-bit ``a, h`` is no good here: the product never wraps ``p = 2^61 - 1``, so every
  function's minimum falls on the same small ``h``.)
* LSH: ``BANDS`` bands of ``ROWS`` rows; documents that share a band are candidates, joined into
  one cluster when their signatures agree on >= ``THRESHOLD`` of the positions (the estimate of
  Jaccard similarity; 0.7 as in BigCode's deduplication). ``BANDS x ROWS = 16 x 8`` puts the
  banding's 50% point at ~0.71, so pairs at 0.7 are found about half the time by one band and
  almost surely by the candidates' own clusters growing.

Written here rather than taken from a MinHash library: the pysource corpus has ~60 M shingles and
must build in a couple of minutes on the machine that trains; a per-shingle Python hash (as the
common libraries do) takes longer than that, and those machines have no internet to install it.
A token's hash is a keyed BLAKE2b of its UTF-8 bytes (not Python's per-process salted ``hash``),
so the clusters depend only on the texts and their order, and the signatures can be computed in
worker processes: the same environment always gives the same corpus.
"""

from __future__ import annotations

import hashlib
import os
import re
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Sequence

import numpy as np

SHINGLE = 5
NUM_PERM = 128
BANDS, ROWS = 16, 8
THRESHOLD = 0.7
_TOKEN = re.compile(r"\w+")
_BLOCK = 4096  # shingles per block of the signature's (shingles x permutations) products


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed bijection of uint64 that spreads every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class MinHasher:
    """Signatures of texts: a fixed family of ``num_perm`` hash functions (from ``seed``)."""

    def __init__(self, num_perm: int = NUM_PERM, seed: int = 0):
        self.keys = np.random.default_rng(seed).integers(0, 1 << 63, size=num_perm, dtype=np.uint64) * np.uint64(2)
        self._token_hashes: dict[str, int] = {}  # a cache: a token's hash is a function of the token

    def _token_hash(self, token: str) -> int:
        h = self._token_hashes.get(token)
        if h is None:
            h = int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")
            self._token_hashes[token] = h
        return h

    def shingles(self, text: str) -> np.ndarray:
        """The distinct 64-bit hashes of the text's 5-token shingles (fewer tokens: one shingle)."""
        h = np.fromiter(map(self._token_hash, _TOKEN.findall(text)), dtype=np.uint64)
        n = max(1, len(h) - SHINGLE + 1) if len(h) else 0
        acc = h[:n].copy()
        for j in range(1, min(SHINGLE, len(h))):  # order-sensitive combination of the tokens' hashes
            acc = _mix64(acc ^ h[j:j + n])
        return np.unique(acc)

    def signature(self, text: str) -> np.ndarray:
        """``NUM_PERM`` uint64 minima; all-max for a text without tokens (matches nothing but itself)."""
        h = self.shingles(text)
        sig = np.full(len(self.keys), np.iinfo(np.uint64).max, dtype=np.uint64)
        for start in range(0, len(h), _BLOCK):
            np.minimum(sig, _mix64(h[start:start + _BLOCK, None] ^ self.keys).min(axis=0), out=sig)
        return sig


def _signatures(texts: Sequence[str], seed: int) -> np.ndarray:
    hasher = MinHasher(seed=seed)
    return np.stack([hasher.signature(t) for t in texts]) if len(texts) else np.zeros((0, NUM_PERM), np.uint64)


def signatures(texts: Sequence[str], seed: int = 0, workers: int | None = None) -> np.ndarray:
    """``(len(texts), NUM_PERM)`` signatures, over ``workers`` processes (default: the CPUs, at
    most 16) for large inputs; the same values however many."""
    workers = min(os.cpu_count() or 1, 16) if workers is None else workers
    if workers <= 1 or len(texts) < 256:
        return _signatures(texts, seed)
    parts = [texts[i::workers] for i in range(workers)]
    # fork: spawn would re-run a caller's script without a __main__ guard; the workers run only
    # numpy and hashlib, none of the parent's threads' locks
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        done = list(pool.map(_signatures, parts, [seed] * workers))
    out = np.empty((len(texts), NUM_PERM), np.uint64)
    for i, part in enumerate(done):
        out[i::workers] = part
    return out


def near_duplicate_clusters(texts: Sequence[str], threshold: float = THRESHOLD,
                            seed: int = 0) -> list[int]:
    """For every text, the index of its cluster's representative (the lowest index in the cluster).
    A text is its own representative unless it shares an LSH band with a text whose signature
    agrees with its own on >= ``threshold`` of the positions."""
    sigs = signatures(texts, seed)
    parent = list(range(len(texts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for band in range(BANDS):
        first: dict[bytes, int] = {}
        rows = sigs[:, band * ROWS:(band + 1) * ROWS]
        for i in range(len(texts)):
            key = rows[i].tobytes()
            j = first.setdefault(key, i)
            if j != i and np.mean(sigs[i] == sigs[j]) >= threshold:
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[max(ri, rj)] = min(ri, rj)
    return [find(i) for i in range(len(texts))]
