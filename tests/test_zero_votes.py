"""Zero casts no vote: a kept coefficient whose value is zero (an all-zero block, a block with
fewer than k non-zero coefficients) adds nothing to any replica's update, in every encoding.

The reference (reference_demo.mean_of_votes) is the math written as a loop: per coefficient,
the mean of the non-zero values the replicas sent for it; the codec's packed bytes are never
consulted to build it.
"""

import pytest
import torch

from flexdemo import DeMo
from flexdemo.compression.codec import (
    mean_of_selected,
    pack_payload,
    scaled_signs,
    sent_values,
    two_levels,
    unpack_payload,
)
from multiproc import run_ranks
from reference_demo import ReferenceDeMo, differs_only_where_update_is_zero, mean_of_votes, reference_two_levels

ENCODINGS = ["fp32", "bf16", "sign", "scaled_sign", "two_bit"]


def _kept(seed, B=5, N=64, k=8):
    """One replica's kept (idx, vals) [B, k] with zeros where an encoder keeps them: block 0
    all zero, block 1 half zero (a -0.0 among them), the rest non-zero; slots in random order."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(B)])
    vals = torch.randn(B, k, generator=g)
    vals[0] = 0.0
    vals[1, ::2] = 0.0
    vals[1, 0] = -0.0
    return idx, vals


def _as_received(vals, encoding):
    """The value each slot carries to the receivers: what the math says, not the codec."""
    if encoding == "bf16":
        return vals.to(torch.bfloat16).float()
    if encoding == "sign":
        return torch.sign(vals)
    if encoding == "scaled_sign":
        voters = (vals != 0).sum(-1, keepdim=True).clamp_min(1)
        return torch.sign(vals) * vals.abs().sum(-1, keepdim=True) / voters
    if encoding == "two_bit":
        return reference_two_levels(vals)
    return vals


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("W", [1, 3])
def test_decoded_mean_counts_only_non_zero_values(encoding, W):
    N, k = 64, 8
    kept = [_kept(seed) for seed in range(W)]
    payloads = []
    for idx, vals in kept:
        sent = {"scaled_sign": scaled_signs, "two_bit": two_levels}.get(encoding, lambda v: v)(vals)
        payloads.append(pack_payload(idx, sent, N, encoding))
    got_idx, got_vals = unpack_payload(torch.stack(payloads), 5, k, N, encoding, torch.float32)
    got = mean_of_selected(got_idx, got_vals, N)

    all_idx = torch.cat([idx for idx, _ in kept], dim=-1)
    all_vals = torch.cat([_as_received(vals, encoding) for _, vals in kept], dim=-1)
    expected = mean_of_votes(all_idx, all_vals, N)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert torch.all(got[0] == 0)  # every replica's block 0 was all zero: nothing at all
    # and the zeros of block 1 took no share of the mean (a zero vote would pull it toward 0)
    assert torch.all(got[1][got[1] != 0].abs() >= expected[1][expected[1] != 0].abs().min())


def test_error_feedback_removes_nothing_for_a_zero():
    vals = torch.tensor([[0.0, -0.0, 1.5]])
    for encoding in ENCODINGS:
        sent = {"scaled_sign": scaled_signs, "two_bit": two_levels}.get(encoding, lambda v: v)(vals)
        assert sent_values(sent, encoding)[0, :2].tolist() == [0.0, 0.0]


def _zero_grad_run(rank, world, encoding, steps):
    g = torch.Generator().manual_seed(0)
    live = torch.randn(64, 64, generator=g).requires_grad_()
    frozen = torch.randn(64, 100, generator=g).requires_grad_()  # zero gradient every step
    unused = torch.randn(130, generator=g).requires_grad_()  # no gradient at all (grad None)
    start = [t.detach().clone() for t in (live, frozen, unused)]
    opt = DeMo([live, frozen, unused], lr=1e-3, compression_topk=8, value_encoding=encoding)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        live.grad = torch.randn(64, 64, generator=data)
        frozen.grad = torch.zeros(64, 100)
        opt.step()
    return [bool(torch.equal(t.detach(), s)) for t, s in zip((live, frozen, unused), start)]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_zero_gradient_parameter_stays_bitwise_unchanged_for_1000_steps(encoding):
    for unchanged_live, unchanged_frozen, unchanged_unused in run_ranks(_zero_grad_run, 2, encoding, 1000):
        assert not unchanged_live  # the optimizer did train
        assert unchanged_frozen and unchanged_unused


def _partial_zero_blocks(rank, world, encoding, steps):
    # Exact zeros made exactly: the rows 64.. never get a gradient, so their 64 x 2 block is all
    # zero (every coefficient exactly 0, no cancellation involved) and its kept slots are all
    # zeros; the other block trains. (Zeros kept beside voters in one block are the codec
    # tests' hand-made slots above.)
    ours = torch.zeros(128, 2).requires_grad_()
    ref = torch.zeros(128, 2).requires_grad_()
    opt = DeMo([ours], lr=1e-2, compression_decay=0.9, compression_topk=96, compression_chunk=64,
               value_encoding=encoding)
    reference = ReferenceDeMo([ref], lr=1e-2, decay=0.9, topk=96, chunk=64, weight_decay=0.0, encoding=encoding)
    data = torch.Generator().manual_seed(7 + rank)
    mismatched = []
    for step in range(steps):
        grad = torch.randn(128, 2, generator=data)
        grad[64:] = 0.0
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        reference.step()
        if not differs_only_where_update_is_zero([ours], [ref], reference.last_decoded):
            mismatched.append(step)
        with torch.no_grad():
            ref.copy_(ours)
    return mismatched, bool(torch.all(ours.detach()[64:] == 0)), bool(torch.any(ours.detach()[:64] != 0))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_kept_zeros_match_the_vote_reference(encoding):
    for mismatched, silent_rows_unchanged, trained in run_ranks(_partial_zero_blocks, 2, encoding, 10):
        assert mismatched == []
        assert silent_rows_unchanged and trained
