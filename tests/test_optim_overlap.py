"""DeMo with overlap=True (the update exchanged at step t applied at step t+1) against an
explicitly delayed independent reference; replicas identical; resuming from the saved
in-flight exchange is exact."""

import torch

from flexdemo import DeMo
from multiproc import run_ranks
from reference_demo import ReferenceDeMo, agrees_then_realign
from toy_problem import all_ranks_equal, backward_on, make_params, run_from

KW = dict(lr=0.01, decay=0.9, topk=8, chunk=64, weight_decay=0.1)


def _demo(params, overlap=True):
    return DeMo(params, lr=KW["lr"], compression_decay=KW["decay"], compression_topk=KW["topk"],
                compression_chunk=KW["chunk"], weight_decay=KW["weight_decay"], value_encoding="fp32",
                overlap=overlap)


def _grads(params, rank, step):
    backward_on(params, 1000 * rank + step)


def _against_delayed_reference(rank, world, steps):
    ours, ref, undelayed = make_params(), make_params(), make_params()
    opt, opt_now = _demo(ours), _demo(undelayed, overlap=False)
    reference = ReferenceDeMo(ref, encoding="fp32", **KW)
    pending = None
    mismatched, diverged = [], []
    for step in range(steps):
        for params in (ours, ref, undelayed):
            _grads(params, rank, step)
        opt.step()
        opt_now.step()
        # The reference, delayed by hand: last step's update first, then this step's DeMo
        # (weight decay, momentum, exchange) with its update held back.
        with torch.no_grad():
            if pending is not None:
                for p, d in zip(ref, pending):
                    p.sub_(KW["lr"] * d.sign())
        applied = pending
        reference.step(apply=False)
        pending = [d.clone() for d in reference.last_decoded]
        if applied is not None:
            if not agrees_then_realign(ours, ref, applied):
                mismatched.append(step)
        if not all_ranks_equal(ours):
            diverged.append(step)
    delay_shows = any(not torch.equal(a, b) for a, b in zip(ours, undelayed))
    return mismatched, diverged, delay_shows


def test_overlap_is_the_delayed_update_exactly():
    for mismatched, diverged, delay_shows in run_ranks(_against_delayed_reference, 2, 12):
        assert mismatched == [] and diverged == []
        assert delay_shows  # and it is not the undelayed optimizer


def _resume(rank, world):
    def run(steps, state=None):
        return run_from(_demo, steps, lambda params, step: _grads(params, rank, step), state)

    full, _ = run(8)
    half, opt = run(5)
    state = (5, opt.state_dict(), {k: v.clone() for k, v in opt.pending_state().items()},
             [p.detach().clone() for p in half])
    resumed, _ = run(8, state)
    return all(torch.equal(a, b) for a, b in zip(full, resumed)), int(state[2]["pending"].item())


def test_resume_with_an_exchange_in_flight_is_exact():
    for same, had_pending in run_ranks(_resume, 2):
        assert had_pending == 1 and same
