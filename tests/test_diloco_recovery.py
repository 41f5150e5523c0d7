"""A discarded DiLoCo cycle is skipped once, not forever: with the inner AdamW of the shipped
configs, one NaN gradient in the second cycle discards that cycle only; every replica resets its
inner optimizer to a fresh state (step 0, zero moments) and later outer steps run and learn,
replicas bit-identical. A fault that repeats stops every rank after ``max_consecutive_skips``
discarded cycles in a row, naming the replica and the parameter."""

import math

import pytest
import torch

from flexdemo.optim.diloco import DiLoCo, RepeatedSkipsError
from multiproc import run_ranks
from toy_problem import INPUT_NUMEL, SHAPES, all_ranks_equal, loss, make_params, outer_sgd

H, LR = 3, 1e-2
NAMES = [f"layer{i}.weight" for i in range(len(SHAPES))]
BAD_PARAM, BAD_AT = 2, (3, 7)  # the element that goes NaN, on replica 1
MODES = [("dense", "fp32"), ("topk", "fp32")]


def _input(seed):
    return torch.randn(INPUT_NUMEL, generator=torch.Generator().manual_seed(seed))


def _backward(params, rank, bad):
    # Each replica its own fixed input: the objective the outer steps minimise is their sum.
    for p in params:
        p.grad = None
    loss(params, _input(rank)).backward()
    if bad:
        params[BAD_PARAM].grad[BAD_AT] = float("nan")


def _objective(params):
    with torch.no_grad():
        return sum(float(loss(params, _input(r))) for r in (0, 1))


def _outer(params, compression, encoding, **kw):
    # top-k: 256 of a 64x64 block's 4096 coefficients, so that 5 outer steps move the toy problem.
    return DiLoCo(list(zip(NAMES, params)), outer_optimizer=outer_sgd(params), sync_interval=H,
                  compression=compression, value_encoding=encoding, topk=256, **kw)


def _inner_state(inner):
    return [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]


def _cycle(outer, inner, params, rank, bad_step=None, reference=None):
    """One cycle of H inner steps and its outer step. ``reference``: (params, AdamW) given the
    same gradients; whether they equal ours bitwise just before the outer step."""
    same_as_reference = None
    for step in range(H):
        outer.before_inner_step()
        _backward(params, rank, bad=step == bad_step)
        inner.step()
        if reference is not None:
            _backward(reference[0], rank, bad=False)
            reference[1].step()
            if step == H - 1:
                same_as_reference = all(torch.equal(a, b) for a, b in zip(params, reference[0]))
        outer.after_inner_step()
    return same_as_reference


def _recovery(rank, world, compression, encoding):
    params = make_params()
    inner = torch.optim.AdamW(params, lr=LR)
    outer = _outer(params, compression, encoding, inner_optimizers=[inner])  # a library caller's way
    out = []
    for cycle in range(5):
        reference = None
        if cycle == 2:  # right after the discarded cycle: a fresh AdamW from the global copy
            ref_params = [p.detach().clone().requires_grad_() for p in params]
            reference = (ref_params, torch.optim.AdamW(ref_params, lr=LR))
        bad_step = 1 if (cycle == 1 and rank == 1) else None
        same_as_fresh = _cycle(outer, inner, params, rank, bad_step, reference)
        state = _inner_state(inner)
        out.append({
            "skipped": outer.last_sync_skipped,
            "identical": all_ranks_equal(params),
            "objective": _objective(params),
            "state_finite": all(torch.isfinite(t).all() for t in state),
            "state_zero": all(not t.any() for t in state),
            "who": outer.last_skipped_by,
            "same_as_fresh": same_as_fresh,
        })
    return out, outer.skips.total, len(outer.skips.in_a_row)


@pytest.mark.parametrize("compression,encoding", MODES)
def test_one_bad_cycle_is_discarded_once_and_training_resumes(compression, encoding):
    for rank_result in run_ranks(_recovery, 2, compression, encoding):
        cycles, skipped_syncs, consecutive = rank_result
        # Before the fix the NaN moments of replica 1's AdamW survived the discard: every later
        # cycle blew up again ([False, True, True, True, True]).
        assert [c["skipped"] for c in cycles] == [False, True, False, False, False]
        assert skipped_syncs == 1 and consecutive == 0
        assert all(c["identical"] for c in cycles)  # every replica, after every outer step
        bad = cycles[1]
        assert bad["who"] == {1: [NAMES[BAD_PARAM]]}, bad["who"]  # the same on every rank
        assert bad["state_finite"] and bad["state_zero"]  # reset on every replica
        # The next cycle is exactly a fresh AdamW's from the global copy.
        assert cycles[2]["same_as_fresh"] is True
        assert all(c["state_finite"] for c in cycles)
        objective = [c["objective"] for c in cycles]
        assert objective[1] == objective[0]  # nothing applied
        assert objective[0] > objective[2] > objective[3] > objective[4], objective  # learning again
        assert all(math.isfinite(x) for x in objective)


def _repeated(rank, world, compression, encoding, bad_cycles, limit, cycles):
    params = make_params()
    outer = _outer(params, compression, encoding, max_consecutive_skips=limit)
    inner = torch.optim.AdamW(params, lr=LR)
    outer.set_inner_optimizers([inner])  # torchtitan's way: the container builds them after the DiLoCo
    skipped = []
    for cycle in range(cycles):
        bad_step = 0 if (cycle in bad_cycles and rank == 1) else None
        try:
            _cycle(outer, inner, params, rank, bad_step)
        except RepeatedSkipsError as e:
            finite = all(torch.isfinite(p).all() for p in params)
            return "stopped", cycle, str(e), skipped, finite, all_ranks_equal(params)
        skipped.append(outer.last_sync_skipped)
    return "ran on", cycles, "", skipped, True, all_ranks_equal(params)


@pytest.mark.parametrize("compression,encoding", MODES)
def test_a_fault_in_every_cycle_stops_every_rank_after_max_consecutive_skips(compression, encoding):
    for how, cycle, msg, skipped, finite, identical in run_ranks(_repeated, 2, compression, encoding,
                                                                  set(range(8)), 3, 8):
        assert how == "stopped" and cycle == 2, (how, cycle, skipped)
        assert skipped == [True, True]
        assert "3 outer steps in a row skipped (max_consecutive_skips = 3)" in msg, msg
        assert f"replica 1 ({NAMES[BAD_PARAM]})" in msg, msg
        assert finite and identical  # stopped on the global copy


def test_only_skips_in_a_row_count():
    # Cycles 0, 1 bad, 2 good, 3, 4, 5 bad: the good cycle starts the count again, so the
    # third skip in a row is cycle 5's.
    for how, cycle, msg, skipped, _, _ in run_ranks(_repeated, 2, "dense", "fp32", {0, 1, 3, 4, 5}, 3, 8):
        assert how == "stopped" and cycle == 5, (how, cycle, skipped)
        assert skipped == [True, True, False, True, True]


def test_zero_never_stops():
    for how, cycle, _, skipped, finite, identical in run_ranks(_repeated, 2, "dense", "fp32", set(range(5)), 0, 5):
        assert how == "ran on" and skipped == [True] * 5 and finite and identical


def test_max_consecutive_skips_must_be_a_count():
    params = make_params()
    for bad in (-1, 2.5, True, None):
        with pytest.raises(ValueError, match="max_consecutive_skips must be an int >= 0"):
            _outer(params, "dense", "fp32", max_consecutive_skips=bad)


@pytest.mark.parametrize("compression", ["dense", "topk"])
def test_without_inner_optimizers_the_first_step_refuses_naming_the_call(compression):
    # Without them a discarded cycle could not reset the inner AdamW, whose NaN moments would then
    # discard every later cycle: refused before anything runs, not found out at the first NaN.
    params = make_params()
    outer = _outer(params, compression, "fp32")
    for step in (outer.before_inner_step, outer.sync):
        with pytest.raises(ValueError, match=r"inner_optimizers=\[inner\].*set_inner_optimizers\(\[inner\]\)"):
            step()
    assert not outer.has_global and outer.outer_steps == 0
    outer.set_inner_optimizers([torch.optim.AdamW(params, lr=LR)])
    outer.before_inner_step()  # given now: runs
    assert outer.has_global
    _outer(params, compression, "fp32", inner_optimizers=()).before_inner_step()  # no inner state: said so
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        _outer(params, compression, "fp32", inner_optimizers=params)  # the parameters by mistake
