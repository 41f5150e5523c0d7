"""DeMo on plain (unsharded) tensors against the independent reference, 2 and 4 replicas."""

import pytest
import torch

from flexdemo import DeMo
from multiproc import run_ranks
from reference_demo import ReferenceDeMo
from toy_problem import INPUT_NUMEL, all_ranks_equal, loss, make_params


def _near_zero_only(ours, ref, reference):
    """Where ours and the reference differ, was the reference's decoded update ~0?

    With sign values the decoded aggregate is often exactly zero in exact arithmetic
    (opposite votes, symmetric cosines); each implementation then takes the sign of its
    own rounding noise. Those elements, and only those, may differ.
    """
    for a, b, dec in zip(ours, ref, reference.last_decoded):
        differs = a != b
        if differs.any() and dec[differs].abs().max() > 1e-5 * dec.abs().max():
            return False
    return True


def _against_reference(rank, world, encoding, steps, weight_decay):
    ours, ref = make_params(0), make_params(0)
    kw = dict(lr=0.01, decay=0.9, topk=8, chunk=64, weight_decay=weight_decay)
    opt = DeMo(ours, lr=kw["lr"], compression_decay=kw["decay"], compression_topk=kw["topk"],
               compression_chunk=kw["chunk"], weight_decay=weight_decay, value_encoding=encoding)
    reference = ReferenceDeMo(ref, encoding=encoding, **kw)
    gen = torch.Generator().manual_seed(1000 + rank)  # every replica sees different data
    mismatched_steps, diverged_steps = [], []
    for step in range(steps):
        x = torch.randn(INPUT_NUMEL, generator=gen)
        for params in (ours, ref):
            for p in params:
                p.grad = None
            loss(params, x).backward()
        opt.step()
        reference.step()
        if encoding == "sign":
            if not _near_zero_only(ours, ref, reference):
                mismatched_steps.append(step)
            with torch.no_grad():  # re-align so rounding-noise differences do not compound
                for a, b, d in zip(ours, ref, reference.delta):
                    b.copy_(a)
                    d.copy_(opt.state[a]["delta"])
        elif not all(torch.equal(a, b) for a, b in zip(ours, ref)):
            mismatched_steps.append(step)
        if not all_ranks_equal(ours):
            diverged_steps.append(step)
    moved = sum(float((a.detach() - b.detach()).abs().sum()) for a, b in zip(ours, make_params(0)))
    return mismatched_steps, diverged_steps, moved, opt.last_step_bytes_sent, opt.payload_bytes_per_step()


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_matches_reference_and_replicas_stay_identical(world):
    results = run_ranks(_against_reference, world, "fp32", 20, 0.0)
    for mismatched, diverged, moved, sent, formula in results:
        assert mismatched == [], f"differs from the reference at steps {mismatched}"
        assert diverged == [], f"replicas diverged at steps {diverged}"
        assert moved > 0
        assert sent == formula > 0


@pytest.mark.parametrize("encoding", ["bf16", "sign"])
def test_compressed_values_match_reference_with_weight_decay(encoding):
    results = run_ranks(_against_reference, 2, encoding, 20, 0.1)
    for mismatched, diverged, moved, _, _ in results:
        assert mismatched == [] and diverged == [] and moved > 0


def _bytes_report(rank, world):
    params = make_params(0)
    opt = DeMo(params, lr=0.01, compression_topk=8, value_encoding="sign")
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt.last_step_bytes_sent, opt.last_step_bytes_received, opt.payload_bytes_per_step()


def test_reported_bytes_follow_the_formula():
    for sent, received, formula in run_ranks(_bytes_report, 4):
        assert sent == formula and received == 3 * formula
