"""How many serial block-wide sums the fused encode's exact top-k search needs per 64x64 block,
for a few search designs, on momentum-like DCT coefficients (CPU, no GPU needed).

The encode kernel is latency-bound on these sums (docs/benchmarks.md section 5), so rounds per
block is the number to cut. Designs: b bits decided per round (2**b - 1 candidate counts per
sum), starting from bit 30, or from the common bit prefix of a bracket [lower, max] where
lower = the smallest row maximum (a valid lower bound of the k-th largest when k <= rows); and
the kernels' interval search (common._interval_search): the quartiles of [lower, max + 1) per
round, keeping the quarter that holds the k-th largest.

    python3 scripts/topk_search_rounds.py --k 32
"""

from __future__ import annotations

import argparse

import torch

from flexdemo.wire.dct import block_layout, blocks_dct


def momentum_like(n: int, steps: int, seed: int) -> torch.Tensor:
    """A decayed sum of white plus spatially smooth gradients (low frequencies stronger)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n, n)
    smooth = torch.nn.AvgPool2d(8, stride=1)
    for _ in range(steps):
        grad = 1e-3 * torch.randn(n, n, generator=g) + smooth(3e-3 * torch.randn(1, n + 7, n + 7, generator=g))[0]
        x = 0.999 * x + 1e-3 * grad
    return x


def search_rounds(bits: torch.Tensor, k: int, step_bits: int, thr: torch.Tensor, top_bit: int) -> torch.Tensor:
    """Rounds per block (row of ``bits``) of the greedy search from ``top_bit`` down, deciding
    ``step_bits`` bits per round, stopping once exactly k values are >= the threshold."""
    thr = thr.clone()
    cnt = torch.full((bits.shape[0],), -1, dtype=torch.int64)
    rounds = torch.zeros(bits.shape[0], dtype=torch.int64)
    lo = top_bit
    while lo >= 0:
        width = min(step_bits, lo + 1)
        base = lo - width + 1
        active = cnt != k
        rounds += active.long()
        new_thr, new_cnt = thr.clone(), cnt.clone()
        for v in range(1, 2**width):  # candidates in increasing order: the last one that fits wins
            cand = thr | (v << base)
            c = (bits >= cand[:, None]).sum(1)
            take = active & (c >= k)
            new_thr, new_cnt = torch.where(take, cand, new_thr), torch.where(take, c, new_cnt)
        thr, cnt = new_thr, new_cnt
        lo -= width
    return rounds


def interval_rounds(bits: torch.Tensor, k: int, lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """Rounds per block of the interval search: count the three quartiles of [lo, hi) (lo: at
    least k values at or above it; hi: fewer), keep the quarter holding the k-th largest, stop
    once a candidate has exactly k values at or above it or hi == lo + 1."""
    lo, hi = lower.long().clone(), upper.long() + 1
    cnt = torch.full_like(lo, -1)
    rounds = torch.zeros_like(lo)
    wide = bits.long()
    while True:
        active = (hi - lo > 1) & (cnt != k)
        if not active.any():
            return rounds
        rounds += active.long()
        q = ((hi - lo) >> 2).clamp(min=1)
        cands = [lo + q, torch.minimum(lo + 2 * q, hi - 1), torch.minimum(lo + 3 * q, hi - 1)]
        counts = [(wide >= c[:, None]).sum(1) for c in cands]
        new_lo, new_cnt, new_hi = lo.clone(), cnt.clone(), hi.clone()
        for c, n in zip(cands, counts):
            take = active & (n >= k)
            new_lo, new_cnt = torch.where(take, c, new_lo), torch.where(take, n, new_cnt)
        for c, n in reversed(list(zip(cands, counts))):
            new_hi = torch.where(active & (n < k), c, new_hi)
        lo, cnt, hi = new_lo, new_cnt, new_hi


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--size", type=int, default=1024, help="one size x size tensor of 64x64 blocks")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    x = momentum_like(args.size, args.steps, args.seed)
    layout = block_layout(x.shape, 64)
    mags = blocks_dct(x, layout).abs().contiguous()
    bits = mags.view(torch.int32)
    zero = torch.zeros(bits.shape[0], dtype=torch.int32)
    for b in (1, 2, 3):
        print(f"{b} bit(s) per round from bit 30: {search_rounds(bits, args.k, b, zero, 30).float().mean():.2f} rounds")
    if args.k <= 64:
        lower = mags.view(-1, 64, 64).amax(2).amin(1).contiguous().view(torch.int32)
        upper = mags.amax(1).contiguous().view(torch.int32)
        first = torch.floor(torch.log2((lower ^ upper).float().clamp(min=1))).long()
        print(f"first bit where the bracket's ends differ: mean {first.float().mean():.1f} "
              f"(min {first.min()}, max {first.max()})")
        for b in (2, 3):
            total = 0
            for s in sorted(set(first.tolist())):
                m = first == s
                prefix = (lower[m] >> (s + 1)) << (s + 1)
                total += int(search_rounds(bits[m], args.k, b, prefix, s).sum())
            print(f"{b} bits per round from the bracket: {total / bits.shape[0]:.2f} rounds "
                  "(+ the bracket's row-max and min/max sums)")
        rounds = interval_rounds(bits, args.k, lower, upper).float()
        print(f"interval search (the kernels'): {rounds.mean():.2f} rounds (max {int(rounds.max())}; "
              "+ the same bracket sums)")


if __name__ == "__main__":
    main()
