"""What every fused codec kernel shares: Triton availability, supported layouts, padded DCT
bases, launch sizes, argument checks and the block-level Triton helpers.

Each program of a kernel owns one ``n1 x n2`` block of the row-major ``[lead, R, C]`` tensor,
numbered row-major over ``(lead, ceil(R / n1), ceil(C / n2))`` as in
:func:`flexdemo.wire.dct.blocks_dct`; a coefficient's index in its block is ``r * n2 + c``.
Blocks at the tensor's edge may be partial: their missing elements load as zeros and are never
stored.
Block sizes up to 64 are supported; sizes that are not powers of two (e.g. 48 rows of the
llama3 embedding shards) are padded to the next power of two with masked loads, zero rows and
columns in the padded DCT matrices, and padded positions excluded from the top-k.

Set ``TRITON_INTERPRET=1`` before importing triton to run the kernels on CPU tensors (slow;
for tests only).
"""

from __future__ import annotations

import functools
import os

import torch

from flexdemo.wire.dct import BlockLayout, dct_matrix

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - triton is a dependency, but keep the torch path usable
    HAVE_TRITON = False

MAX_BLOCK = 64  # one 64x64 fp32 block is 32 registers per thread at 4 warps; larger would spill
# Kept coefficients enter the inverse DCT as gathered basis functions, TOPK_CHUNK per product
# (sparse_idct): the work grows linearly in K, the decode's replica-overlap count as (W * K)**2.
# Whole [64, K] tiles spilled registers (K = 1024 did not finish in 2 minutes on an H200).
# Larger K takes the torch path.
MAX_TOPK = 256
TOPK_CHUNK = 32
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_cache_dir() -> str:
    """Where Triton keeps compiled kernels between runs (its knob, else its documented default)."""
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # older Triton: no knobs
        return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def pow2_at_least(n: int, floor: int = 16) -> int:
    # tl.arange needs powers of two and tl.dot needs every dim >= 16.
    p = floor
    while p < n:
        p *= 2
    return p


def sparse_plan(k: int, p1: int, p2: int) -> dict:
    """Launch constants for k kept coefficients per padded p1 x p2 block: KP (k padded to a power
    of two), KC (coefficients per gathered-basis product, a power of two >= 16), and SPARSE_EF:
    whether the encode's error feedback takes the gathered basis functions (k products of
    size p1 x p2 in chunks) rather than the dense inverse DCT (two p x p x p products)."""
    kp = pow2_at_least(k)
    return {"KP": kp, "KC": min(kp, TOPK_CHUNK), "SPARSE_EF": kp < p1 + p2}


# Launch choices that change speed only, never bits, are fixed here, not read from the
# environment and not config keys of the start-up agreement (which holds every choice that
# changes what a replica computes): the top-k search's bracket (search_bracket), the warps per
# block (num_warps), the register ceilings (launch_options) and the grouped kernels' alignment
# hints (tables.align_hints). The bracket and the hints are tested bitwise-equal to their
# alternatives (tests/test_fused_codec.py, tests/test_fused_grouped.py); warps and registers are
# launch options. Functions that time or compare them take them as keyword arguments.


def search_bracket(k: int, n1: int) -> bool:
    """Whether the encode's top-k search narrows the bracket [smallest row max, block max]
    (common.topk_threshold's interval search; valid for k <= n1 rows) rather than building the
    threshold from the top bit: ~3.8 instead of ~7.4 rounds per block on momentum-like data
    (counted on CPU on synthetic momentum-like DCT coefficients). The selection
    is the same either way (tested through fused_encode's ``bracket`` argument)."""
    return k <= n1


def fused_supported(layout: BlockLayout, device: torch.device | str, dtype: torch.dtype = torch.float32,
                    topk: int | None = None) -> bool:
    """Whether the fused kernels handle this layout on this device (else use the torch path).

    Needs a tensor with at least 1 dim (``[..., R, C]``, leading dims folded into rows; a 1-D
    tensor is one row, blocks of ``1 x n2`` as in :func:`flexdemo.wire.dct.block_layout`),
    DCT blocks (not ``transform="none"``) of at most 64 x 64, at most MAX_TOPK coefficients kept per
    block, fp32 data, and a CUDA device (or CPU under ``TRITON_INTERPRET=1``).
    """
    device = torch.device(device)
    if not HAVE_TRITON or dtype != torch.float32:
        return False
    if topk is not None and topk > MAX_TOPK:
        return False
    if device.type != "cuda" and not (device.type == "cpu" and INTERPRET):
        return False
    if len(layout.shape) < 1 or layout.num_blocks == 0 or layout.transform != "dct":
        return False
    if pow2_at_least(layout.n1) * layout.cols >= 2**31:  # in-block offsets are int32 (block_offsets)
        return False
    return 1 <= layout.n1 <= MAX_BLOCK and 1 <= layout.n2 <= MAX_BLOCK


_PADDED: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def padded_dct(n: int, p: int, device: torch.device) -> torch.Tensor:
    """``dct_matrix(n)`` in the top-left corner of a ``p x p`` zero matrix (fp32, contiguous)."""
    key = (n, p, torch.device(device))
    f = _PADDED.get(key)
    if f is None:
        f = torch.zeros(p, p, dtype=torch.float32, device=device)
        f[:n, :n] = dct_matrix(n, torch.float32, device)
        _PADDED[key] = f
    return f


def num_warps(p1: int, p2: int) -> int:
    return 4 if p1 * p2 >= 2048 else 2


# Register ceilings per kernel on Hopper (sm_90; an SM has 64 K registers), for more blocks per
# SM: the encode at 4 warps held two blocks at ~250 registers, three at 168 (with spills); the
# mean decode three at 136, four at 128 (no spills). On an H200, llama3-8B shard: grouped encode
# 16.97 -> 15.37 ms, decode 6.7 -> 6.0 ms (measured once, one H200). Other
# architectures keep the compiler's choice (not measured).
HOPPER_MAXNREG = {"encode": 168, "decode": 128}


def launch_options(kernel: str, p1: int, p2: int, capability: tuple[int, int] | None, *,
                   maxnreg: int | None = None) -> dict:
    """The launch options of the fused ``kernel`` ("encode" or "decode") for padded p1 x p2
    blocks on a device of compute ``capability`` (None: CPU): num_warps, and a register
    ceiling (``maxnreg``): HOPPER_MAXNREG's on sm_90, or the ``maxnreg`` argument's (an integer
    in [24, 255]; 0: none), for timing or profiling another ceiling. Only speed changes;
    results are the same."""
    options = {"num_warps": num_warps(p1, p2)}
    if maxnreg is None:
        ceiling = HOPPER_MAXNREG.get(kernel) if capability is not None and capability[0] == 9 else None
    elif isinstance(maxnreg, int) and not isinstance(maxnreg, bool) and (maxnreg == 0 or 24 <= maxnreg <= 255):
        ceiling = maxnreg or None
    else:
        raise ValueError(f"maxnreg must be 0 (no ceiling) or an integer in [24, 255], got {maxnreg!r}")
    if ceiling is not None:
        options["maxnreg"] = ceiling
    return options


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_tensor(t: torch.Tensor, layout: BlockLayout, what: str) -> None:
    if t.dtype != torch.float32:
        raise TypeError(f"fused codec: {what} must be float32, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"fused codec: {what} must be contiguous")
    if tuple(t.shape) != tuple(layout.shape):
        raise ValueError(f"fused codec: {what} has shape {tuple(t.shape)}, layout says {layout.shape}")


if HAVE_TRITON:

    @triton.jit
    def flat_exclusive_cumsum(x):
        # Exclusive prefix sum of a 2-D int tile in row-major (flattened) order: a cumsum along
        # each row plus the total of all earlier rows. Avoids reshaping the tile to 1-D.
        row_incl = tl.cumsum(x, axis=1)
        row_tot = tl.sum(x, axis=1)
        row_off = tl.cumsum(row_tot, axis=0) - row_tot
        return row_off[:, None] + row_incl - x

    @triton.jit
    def _count_ge(bits, t1, t2, t3):
        # How many bits are >= each of three thresholds, in one block-wide sum: the search is
        # latency-bound on its block-wide sums, so one per two bits of the search. Each row's
        # three counts in 10-bit fields of an int32 (a row has <= MAX_BLOCK = 64 < 2**10
        # elements: 32-bit adds per element), then the rows' in 16-bit fields of an int64 (a
        # block has <= 64 * 64 < 2**16).
        packed = ((bits >= t1).to(tl.int32) | ((bits >= t2).to(tl.int32) << 10)
                  | ((bits >= t3).to(tl.int32) << 20))
        rows = tl.sum(packed, axis=1)
        wide = ((rows & 0x3FF).to(tl.int64) | (((rows >> 10) & 0x3FF).to(tl.int64) << 16)
                | ((rows >> 20).to(tl.int64) << 32))
        s = tl.sum(wide, axis=0)
        return s & 0xFFFF, (s >> 16) & 0xFFFF, s >> 32

    @triton.jit
    def topk_threshold(bits, K: tl.constexpr, TOTAL, BRACKET: tl.constexpr):
        # The k-th largest of a tile of non-negative int32 (padding -1, TOTAL values >= 0), or
        # any threshold with exactly K values at or above it: thr and cnt = count(bits >= thr),
        # cnt == K (then bits >= thr are exactly the top K) or thr the k-th largest value itself
        # (ties at it). The search is latency-bound on its block-wide sums, so both designs
        # count three candidates per sum (_count_ge) and stop as soon as one has exactly K.
        if BRACKET:
            thr, cnt = _interval_search(bits, K)
        else:
            thr, cnt = _top_bit_search(bits, K, TOTAL)
        return thr, cnt

    @triton.jit
    def _top_bit_search(bits, K: tl.constexpr, TOTAL):
        # Built from the top bit down: thr, the largest pattern seen so far with
        # cnt = count(bits >= thr) >= K, two bits per round (usually ~7 of the 16 rounds).
        thr = tl.full([], 0, tl.int32)
        cnt = tl.full([], 0, tl.int32) + TOTAL
        lo = tl.full([], 29, tl.int32)  # rounds decide bits (lo + 1, lo): (30, 29), ..., (2, 1)
        while (lo >= 1) & (cnt != K):
            c1, c2, c3 = thr | (1 << lo), thr | (2 << lo), thr | (3 << lo)
            n1, n2, n3 = _count_ge(bits, c1, c2, c3)
            thr, cnt = tl.where(n1 >= K, c1, thr), tl.where(n1 >= K, n1.to(tl.int32), cnt)
            thr, cnt = tl.where(n2 >= K, c2, thr), tl.where(n2 >= K, n2.to(tl.int32), cnt)
            thr, cnt = tl.where(n3 >= K, c3, thr), tl.where(n3 >= K, n3.to(tl.int32), cnt)
            lo -= 2
        if cnt != K:  # bit 0
            n0 = tl.sum(tl.sum((bits >= (thr | 1)).to(tl.int32), axis=1), axis=0)
            thr = tl.where(n0 >= K, thr | 1, thr)
            cnt = tl.where(n0 >= K, n0, cnt)
        return thr, cnt

    @triton.jit
    def _interval_search(bits, K: tl.constexpr):
        # Caller-checked K <= valid rows: every row's maximum is >= the smallest of them, so at
        # least K values are >= lo = that smallest row maximum, and none >= hi = block max + 1.
        # Each round counts the three quartiles of [lo, hi) (bit patterns order like the
        # floats) and keeps the quarter holding the k-th largest: on momentum-like blocks ~3.8
        # rounds where the earlier search from the common bit prefix of lo and hi took ~4.6
        # (that prefix is often the exponent alone; scripts/topk_search_rounds.py). int64 bounds:
        # hi may be 2**31.
        row_max = tl.max(bits, axis=1)
        lo = tl.min(tl.where(row_max >= 0, row_max, 0x7FFFFFFF), axis=0).to(tl.int64)
        hi = tl.max(row_max, axis=0).to(tl.int64) + 1
        cnt = tl.full([], -1, tl.int32)  # count(bits >= lo), unknown until a round counts it
        while (hi - lo > 1) & (cnt != K):
            q = tl.maximum((hi - lo) >> 2, 1)
            c1 = lo + q
            c2 = tl.minimum(lo + 2 * q, hi - 1)
            c3 = tl.minimum(lo + 3 * q, hi - 1)
            n1, n2, n3 = _count_ge(bits, c1.to(tl.int32), c2.to(tl.int32), c3.to(tl.int32))
            lo, cnt = tl.where(n1 >= K, c1, lo), tl.where(n1 >= K, n1.to(tl.int32), cnt)
            lo, cnt = tl.where(n2 >= K, c2, lo), tl.where(n2 >= K, n2.to(tl.int32), cnt)
            lo, cnt = tl.where(n3 >= K, c3, lo), tl.where(n3 >= K, n3.to(tl.int32), cnt)
            hi = tl.where(n3 < K, c3, hi)
            hi = tl.where(n2 < K, c2, hi)
            hi = tl.where(n1 < K, c1, hi)
        thr = lo.to(tl.int32)  # cnt == K, or hi == lo + 1: lo is the k-th largest value
        if cnt < 0:  # no round counted lo
            cnt = tl.sum(tl.sum((bits >= thr).to(tl.int32), axis=1), axis=0)
        return thr, cnt

    @triton.jit
    def round_bf16(y):
        # fp32 -> nearest bf16 (ties to even) -> fp32, by integer rounding of the top 16 bits:
        # explicit because the interpreter's .to(tl.bfloat16) truncates. NaN passes through.
        u = y.to(tl.uint32, bitcast=True)
        u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
        return tl.where(y != y, y, u.to(tl.float32, bitcast=True))

    @triton.jit
    def block_offsets(b, R, C, blocks_per_row, N1: tl.constexpr, N2: tl.constexpr, P1: tl.constexpr,
                      P2: tl.constexpr, PARTIAL: tl.constexpr):
        # Block b of a row-major [lead, R, C] tensor, blocks numbered row-major over (lead,
        # ceil(R / N1), ceil(C / N2)): the offset of its first element (int64: tensors may exceed
        # 2**31 elements), its elements' offsets from there (int32: P1 * C < 2**31 is checked by
        # fused_supported, so there is no 64-bit math per element), `valid` (the elements inside
        # the tensor: loads and stores) and `inblock` (the N1 x N2 coefficient positions). With
        # PARTIAL (some tensor of the launch is not a whole number of blocks) a block at the
        # tensor's edge may be partial, and the DCT sees it zero-padded; without it the masks are
        # compile-time constants, so the loads stay unmasked and vectorized.
        r = tl.arange(0, P1)
        c = tl.arange(0, P2)
        bi = b // blocks_per_row
        bj = b - bi * blocks_per_row
        offs = r[:, None] * C + c[None, :]
        inblock = (r[:, None] < N1) & (c[None, :] < N2)
        valid = inblock
        if PARTIAL:
            row_blocks = (R + N1 - 1) // N1
            lead = bi // row_blocks
            row0 = (bi - lead * row_blocks) * N1
            base = (lead.to(tl.int64) * R + row0) * C + bj * N2
            valid = inblock & (row0 + r[:, None] < R) & (bj * N2 + c[None, :] < C)
        else:
            base = (bi * N1).to(tl.int64) * C + bj * N2
        return base, offs, valid, inblock, r, c

    @triton.jit
    def sparse_idct(i, m, f1_ptr, f2_ptr, N2: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                    PREC: tl.constexpr):
        # F1^T @ S @ F2 for a block S holding m[j] at flat index i[j] (distinct; i < 0: none):
        # sum_j m[j] * outer(F1[r_j, :], F2[c_j, :]), one [P1, KC] x [KC, P2] product of gathered
        # basis rows, against two [P, P] x [P, P] products for the dense block.
        ok = i >= 0
        i = tl.where(ok, i, 0)
        rj = i // N2
        cj = i - rj * N2
        a = tl.load(f1_ptr + rj[None, :] * P1 + tl.arange(0, P1)[:, None])  # a[x, j] = F1[r_j, x]
        bm = tl.load(f2_ptr + cj[:, None] * P2 + tl.arange(0, P2)[None, :]) * tl.where(ok, m, 0.0)[:, None]
        return tl.dot(a, bm, input_precision=PREC)

    @triton.jit
    def idct_block(s, f1_ptr, f2_ptr, P1: tl.constexpr, P2: tl.constexpr, PREC: tl.constexpr):
        # F1^T @ s @ F2 (orthonormal basis: the transpose is the inverse).
        i1 = tl.arange(0, P1)
        i2 = tl.arange(0, P2)
        f1t = tl.load(f1_ptr + i1[None, :] * P1 + i1[:, None])  # f1t[i, r] = F1[r, i]
        f2 = tl.load(f2_ptr + i2[:, None] * P2 + i2[None, :])
        t = tl.dot(f1t, s, input_precision=PREC)
        return tl.dot(t, f2, input_precision=PREC)


def geometry(layout: BlockLayout, device):
    p1, p2 = pow2_at_least(layout.n1), pow2_at_least(layout.n2)
    return p1, p2, padded_dct(layout.n1, p1, device), padded_dct(layout.n2, p2, device), layout.col_blocks
