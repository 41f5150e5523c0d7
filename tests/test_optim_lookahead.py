"""DeMo with overlap and lookahead against an independent reference: the replicas' common
parameters (the base) take each exchanged update one step late, bit-identical on every replica;
the live parameters are the base minus lr x sign(this replica's own payload decoded alone);
consensus() shows the base and gives the live parameters back bit for bit; resuming from a
checkpoint of live parameters, base and the exchange in flight equals the uninterrupted run."""

import pytest
import torch

from flexdemo import DeMo
from multiproc import run_ranks
from reference_demo import ReferenceDeMo, agrees_then_realign, differs_only_where_update_is_zero
from toy_problem import all_ranks_equal, backward_on, make_params, run_from
from torchtitan_version import needs_torchtitan_0_2

# top-512 per full 64 x 64 block: the toy's small blocks (7 x 11, 64-element chunks) keep 8-10
# coefficients, as top-8 kept before format 5 scaled k to a block's share. At one coefficient a
# block, two implementations whose DCT bases round differently pick different ones on near-ties.
LR, WD, DECAY, TOPK = 0.01, 0.1, 0.9, 512


def _demo(params, encoding="sign"):
    return DeMo(params, lr=LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=64,
                weight_decay=WD, value_encoding=encoding, overlap=True, lookahead=True)


def _against_reference(rank, world, encoding, steps):
    ours, ref = make_params(), make_params()
    opt = _demo(ours, encoding)
    reference = ReferenceDeMo(ref, lr=LR, decay=DECAY, topk=TOPK, chunk=64, weight_decay=0.0, encoding=encoding)
    consensus = [p.detach().clone() for p in ref]  # the reference's base, kept by hand
    pending, live_bad, base_bad, base_apart, live_apart, restored = None, [], [], [], [], []
    for step in range(steps):
        lr = LR * (1 + 0.2 * step)  # the look-ahead and the delayed update each carry their own step's lr
        opt.param_groups[0]["lr"] = reference.lr = lr
        for params in (ours, ref):
            backward_on(params, 1000 * rank + step)  # gradients at the live (look-ahead) parameters
        opt.step()
        with torch.no_grad():  # reference: last step's exchanged update on the base, then weight decay
            if pending is not None:
                for c, d in zip(consensus, pending[0]):
                    c.sub_(pending[1] * d.sign())
            for c in consensus:
                c.mul_(1 - lr * WD)
        reference.step(apply=False)
        previous = pending[0] if pending is not None else [torch.zeros_like(c) for c in consensus]
        pending = ([d.clone() for d in reference.last_decoded], lr)
        with torch.no_grad():
            for p, c, own in zip(ref, consensus, reference.last_own_decoded):
                p.copy_(c - lr * own.sign())
        live = [p.detach().clone() for p in ours]
        with opt.consensus():
            base = [p.detach().clone() for p in ours]
        restored.append(all(torch.equal(p, q) for p, q in zip(ours, live)))
        if not differs_only_where_update_is_zero(base, consensus, previous):
            base_bad.append(step)
        with torch.no_grad():
            for c, b in zip(consensus, base):
                c.copy_(b)
        if not agrees_then_realign(ours, ref, reference.last_own_decoded):
            live_bad.append(step)
        base_apart.append(not all_ranks_equal(base))
        live_apart.append(not all_ranks_equal(live))
    return live_bad, base_bad, base_apart, live_apart, restored


@pytest.mark.parametrize("encoding", ["sign", "fp32"])
def test_lookahead_matches_reference_and_bases_stay_identical(encoding):
    for live_bad, base_bad, base_apart, live_apart, restored in run_ranks(_against_reference, 2, encoding, 8):
        assert base_bad == [], f"the base differs from the reference's at steps {base_bad}"
        assert live_bad == [], f"the live parameters differ from the reference's at steps {live_bad}"
        assert not any(base_apart), "replicas' bases differ"
        assert all(live_apart), "live parameters equal on every replica: no look-ahead was applied"
        assert all(restored), "consensus() did not give the live parameters back bit for bit"


def _resume(rank, world):
    def run(steps, state=None):
        params, opt = run_from(_demo, steps, lambda ps, step: backward_on(ps, 1000 * rank + step), state)
        opt.finish_pending()  # the last update in, the look-ahead out
        return params, opt

    full, _ = run(8)
    params, opt = run_from(_demo, 5, lambda ps, step: backward_on(ps, 1000 * rank + step))
    # A checkpoint holds one replica's live parameters (DCP keeps one copy of equal keys):
    # replica 1 resumes from replica 0's, its own base and the exchange in flight.
    values = [p.detach().clone() for p in make_params(seed=rank)] if rank else [p.detach().clone() for p in params]
    state = (5, opt.state_dict(), {k: v.clone() for k, v in opt.pending_state().items()}, values)
    resumed, _ = run(8, state)
    return all(torch.equal(a, b) for a, b in zip(full, resumed)), all_ranks_equal(resumed)


def test_resume_with_a_lookahead_in_flight_is_exact():
    for exact, identical in run_ranks(_resume, 2):
        assert exact and identical


def test_lookahead_needs_overlap():
    with pytest.raises(ValueError, match="lookahead needs overlap=True"):
        DeMo(make_params(), lr=LR, lookahead=True)


@needs_torchtitan_0_2
def test_lookahead_without_overlap_is_one_config_error():
    from torchtitan.config import ConfigManager

    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = ConfigManager().parse_args(["--job.custom_config_module", "flexdemo.titan.config",
                                      "--flexdemo.overlap_lookahead"])
    with pytest.raises(FlexDemoConfigError, match="overlap_lookahead = true needs overlap = true"):
        validate_job_config(job, None)
