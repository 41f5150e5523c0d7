"""DeMo's momentum in bf16 (momentum_dtype="bfloat16"): stochastic rounding that keeps small
increments, the same step as an fp32 momentum up to that rounding, sharded == unsharded, and
resume == uninterrupted."""

import pytest
import torch

from flexdemo import DeMo
from flexdemo.optim.bounded_groups import bounded_groups
from flexdemo.wire.stochastic_rounding import box_of, positions, stochastic_round_torch
from fsdp_toy import replica_mesh, shard_layers, toy_mlp
from multiproc import run_ranks


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above ``x`` (equal where bf16 holds x), found with
    torch's own rounding and nextafter, not with bit tricks."""
    near = x.to(torch.bfloat16)
    up = torch.nextafter(near, torch.full_like(near, float("inf")))
    down = torch.nextafter(near, torch.full_like(near, float("-inf")))
    exact = near.float() == x
    lo = torch.where(exact | (near.float() < x), near, down).float()
    hi = torch.where(exact | (near.float() > x), near, up).float()
    return lo, hi


def _round(x: torch.Tensor, seed: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    stochastic_round_torch(out, x, box_of(x), seed)
    return out.float()


def test_rounds_to_a_neighbour_up_with_the_right_probability():
    n = 200_000
    for value in (1.0 + 2**-10, -(3.0 + 5 * 2**-9), 1e-30 * (1 + 2**-11)):
        x = torch.full((n,), value)
        lo, hi = _bf16_neighbours(x)
        r = _round(x, seed=12345)
        assert torch.all((r == lo) | (r == hi))
        p_up = float((r == hi).float().mean())
        expected = float((x - lo)[0] / (hi - lo)[0])
        assert abs(p_up - expected) < 0.005, (value, p_up, expected)
    exact = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0 * 2**-100, float("inf"), float("-inf")])
    assert torch.equal(_round(exact, seed=7), exact)
    assert torch.isnan(_round(torch.tensor([float("nan")]), seed=7)).all()


def test_small_increments_survive_where_round_to_nearest_loses_them():
    """1.0 plus 1e-4, a thousand times: round-to-nearest stays at 1.0 (the increment is under half
    of bf16's spacing 2**-7), stochastic rounding ends near 1.1."""
    m = torch.ones(4096)
    for step in range(1000):
        m = _round(m + 1e-4, seed=step)
    assert abs(float(m.mean()) - 1.1) < 0.002, float(m.mean())
    assert float((torch.ones(4096).bfloat16() + 1e-4).float().mean()) == 1.0  # what it saves us from


def test_rounding_bits_depend_on_the_position_and_the_seed():
    x = torch.full((64, 64), 1.0 + 2**-9)
    a, b = _round(x, seed=1), _round(x, seed=2)
    assert not torch.equal(a, b)
    assert torch.equal(a, _round(x, seed=1))
    # A slice of rows rounds as the same rows of the whole tensor only with their own positions.
    assert bounded_groups([3, 3, 5, 1], limit=6) == [[0, 1], [2, 3]]
    assert bounded_groups([10, 1], limit=4) == [[0], [1]]


KW = dict(lr=0.01, compression_decay=0.95, compression_topk=16, compression_chunk=64, value_encoding="sign")


def _low_and_ref(**kw):
    """The toy model twice: (model, DeMo with a bf16 momentum), (model, DeMo with an fp32 one)."""
    low, ref = toy_mlp(0), toy_mlp(0)
    return (low, DeMo(low.parameters(), momentum_dtype="bfloat16", **kw)), (ref, DeMo(ref.parameters(), **kw))


def _step_realigned(pairs, x, poison: bool = False) -> None:
    """One step of both on the batch ``x``, the fp32 one first handed the bf16 one's momentum
    (widened); ``poison``: a NaN in each first gradient."""
    (low, opt_low), (ref, opt_ref) = pairs
    for model, opt in pairs:
        opt.zero_grad()
        model(x).square().mean().backward()
        if poison:
            next(model.parameters()).grad[0, 0] = float("nan")
    for pl, pr in zip(low.parameters(), ref.parameters()):
        if "delta" in opt_low.state[pl]:
            opt_ref.state[pr]["delta"] = opt_low.state[pl]["delta"].float()
    opt_low.step()
    opt_ref.step()


def _params_equal(pairs) -> bool:
    (low, _), (ref, _) = pairs
    return all(torch.equal(pl, pr) for pl, pr in zip(low.parameters(), ref.parameters()))


def _worst_in_bf16_steps(pairs) -> float:
    """The largest |bf16 momentum - fp32 momentum| of a tensor, in bf16 steps at that tensor's
    largest fp32 value."""
    (low, opt_low), (ref, opt_ref) = pairs
    return max(float((opt_low.state[pl]["delta"].float() - opt_ref.state[pr]["delta"]).abs().max()
                     / (opt_ref.state[pr]["delta"].abs().max() * 2**-7))
               for pl, pr in zip(low.parameters(), ref.parameters()))


def _bf16_vs_fp32_step(rank, world, steps):
    """Each step, an fp32-momentum DeMo is handed the bf16 one's momentum (widened) and the same
    gradient: the parameters must come out bit-identical (the payload is encoded from fp32 either
    way) and the bf16 momentum must be one of the two bf16 neighbours of the fp32 one."""
    pairs = (low, opt_low), (ref, opt_ref) = _low_and_ref(**KW)
    gen = torch.Generator().manual_seed(100 + rank)
    params_equal, outside, rounded_up, rounded_down, inexact = True, 0, 0, 0, 0
    near_lo_up, near_lo = 0, 0  # fp32 values in the lower quarter between their bf16 neighbours
    for _ in range(steps):
        _step_realigned(pairs, torch.randn(8, 64, generator=gen))
        params_equal &= _params_equal(pairs)
        for pl, pr in zip(low.parameters(), ref.parameters()):
            m, r = opt_low.state[pl]["delta"], opt_ref.state[pr]["delta"]
            assert m.dtype == torch.bfloat16 and r.dtype == torch.float32
            lo, hi = _bf16_neighbours(r)
            m = m.float()
            outside += int(((m != lo) & (m != hi)).sum())
            inexact += int((lo != hi).sum())
            rounded_up += int(((m == hi) & (lo != hi)).sum())
            rounded_down += int(((m == lo) & (lo != hi)).sum())
            low_quarter = (lo != hi) & ((r - lo) < 0.25 * (hi - lo))
            near_lo += int(low_quarter.sum())
            near_lo_up += int((low_quarter & (m == hi)).sum())
    return params_equal, outside, rounded_up, rounded_down, inexact, near_lo_up / max(near_lo, 1)


def test_same_step_as_fp32_momentum_up_to_the_rounding():
    for params_equal, outside, up, down, inexact, up_from_low_quarter in run_ranks(_bf16_vs_fp32_step, 2, 6):
        assert params_equal
        assert outside == 0
        assert up + down == inexact and up > 0.2 * inexact and down > 0.2 * inexact, (up, down, inexact)
        # Stochastic, not to-nearest: values in the lower quarter still go up, about 1 time in 8.
        assert 0.08 < up_from_low_quarter < 0.17, up_from_low_quarter


def _sharded_vs_unsharded(rank, world, steps):
    mesh = replica_mesh(2, 2)
    replica = mesh["replicate"].get_local_rank()
    sharded = shard_layers(toy_mlp(0), mesh["shard"])
    plain = toy_mlp(0)
    kw = dict(KW, value_encoding="fp32", replicate_group=mesh["replicate"].get_group(), momentum_dtype="bfloat16")
    opt_sharded, opt_plain = DeMo(sharded.parameters(), **kw), DeMo(plain.parameters(), **kw)
    gen = torch.Generator().manual_seed(100 + replica)
    for _ in range(steps):
        x = torch.randn(8, 64, generator=gen)
        for model, opt in ((sharded, opt_sharded), (plain, opt_plain)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    params = all(torch.equal(ps.full_tensor(), pp) for ps, pp in zip(sharded.parameters(), plain.parameters()))
    differ, total, worst_ulps = 0, 0, 0.0
    for ps, pp in zip(sharded.parameters(), plain.parameters()):
        a, b = opt_sharded.state[ps]["delta"].full_tensor().float(), opt_plain.state[pp]["delta"].float()
        lo, hi = _bf16_neighbours(b)
        ulp = torch.where(hi > lo, hi - lo, torch.nextafter(b.bfloat16(), torch.full_like(b, 1e30).bfloat16()).float() - b)
        differ += int((a != b).sum())
        total += a.numel()
        worst_ulps = max(worst_ulps, float(((a - b).abs() / ulp).max()))
    boxes = [box_of(p) for p in sharded.parameters()]
    return params, differ, total, worst_ulps, [(tuple(p.shape), positions(b, 0, b.rows, "cpu").flatten().tolist())
                                              for p, b in zip(sharded.parameters(), boxes)]


def test_sharded_equals_unsharded_with_bf16_momentum():
    """The rounding's bits follow each element's place in the whole tensor, so FSDP shards round as
    the unsharded tensor does: the parameters are bit-identical, and so is the momentum except
    where the fp32 arithmetic already differs in its last bits (a 1-D DCT over a shard is batched
    differently; an fp32 momentum differs there too), by at most one bf16 step."""
    results = run_ranks(_sharded_vs_unsharded, 4, 8)
    for params, differ, total, worst_ulps, _ in results:
        assert params
        assert differ <= total // 1000 and worst_ulps <= 1.0, (differ, total, worst_ulps)
    # The shards' positions tile each whole tensor exactly (ranks 0 and 1: one replica's 2 shards).
    for (shape, pos0), (_, pos1) in zip(results[0][4], results[1][4]):
        assert sorted(pos0 + pos1) == list(range(len(pos0) + len(pos1))), shape


def _resume(rank, world, steps, at):
    def run(stop_at=None, state=None):
        model = toy_mlp(0)
        opt = DeMo(model.parameters(), momentum_dtype="bfloat16", **KW)
        if state is not None:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(steps):
            x = torch.randn(8, 64, generator=gen)
            if state is not None and step < at:
                continue  # the data the saved run already trained on
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            if step + 1 == stop_at:
                import copy
                return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        return model, opt

    whole_model, whole_opt = run()
    resumed_model, resumed_opt = run(state=run(stop_at=at))
    params = all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    momenta = all(torch.equal(whole_opt.state[a]["delta"], resumed_opt.state[b]["delta"])
                  and resumed_opt.state[b]["delta"].dtype == torch.bfloat16  # torch's load casts to the param's
                  and resumed_opt.state[b]["rounding_step"].dtype == torch.int64
                  for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    return params, momenta


def test_resume_equals_uninterrupted_with_bf16_momentum():
    for params, momenta in run_ranks(_resume, 2, 8, 3):
        assert params and momenta


def test_bad_momentum_dtype_is_refused():
    with pytest.raises(ValueError, match="momentum_dtype"):
        DeMo(toy_mlp(0).parameters(), momentum_dtype="float16", **KW)


def _sharded_exchange_restores(rank, world, steps):
    """The sharded exchange gives back, every step, what its owners dropped (MomentumStorage.restore):
    with a bf16 momentum that is a second stochastic rounding. Against an fp32-momentum DeMo handed
    the same momentum each step: the same parameters (the payload comes from the same fp32 values),
    and a momentum within two bf16 steps (at the tensor's largest value) of the fp32 one: two
    roundings, the first of the momentum before the give-back, which is of that size."""
    pairs = (_, _), (ref, opt_ref) = _low_and_ref(**dict(KW, value_encoding="fp32", exchange="sharded",
                                                          sharded_topk=4))
    gen = torch.Generator().manual_seed(100 + rank)
    params_equal, worst_ulps, restored = True, 0.0, 0.0
    for _ in range(steps):
        _step_realigned(pairs, torch.randn(8, 64, generator=gen))
        params_equal &= _params_equal(pairs)
        worst_ulps = max(worst_ulps, _worst_in_bf16_steps(pairs))
        restored += sum(float(opt_ref.state[p]["delta"].abs().sum()) for p in ref.parameters())
    return params_equal, worst_ulps, restored


def test_the_sharded_exchanges_give_back_is_rounded_into_the_bf16_momentum():
    for params_equal, worst_ulps, restored in run_ranks(_sharded_exchange_restores, 2, 5):
        assert params_equal
        assert worst_ulps <= 2.0, worst_ulps
        assert restored > 0


def _through_distributed_state_dict(rank, world):
    """torchtitan saves and loads optimizers through torch.distributed.checkpoint.state_dict (get /
    set_optimizer_state_dict), which ends in DeMo.load_state_dict: the momentum stays bf16."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = toy_mlp(0)
    opt = DeMo(model.parameters(), momentum_dtype="bfloat16", **KW)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt)
    fresh = DeMo(model.parameters(), momentum_dtype="bfloat16", **KW)
    set_optimizer_state_dict(model, fresh, saved)
    return all(fresh.state[p]["delta"].dtype == torch.bfloat16 and torch.equal(fresh.state[p]["delta"],
                                                                              opt.state[p]["delta"])
               and fresh.state[p]["rounding_step"].dtype == torch.int64 for p in model.parameters())


def test_the_momentum_stays_bf16_through_torchs_distributed_state_dict():
    assert all(run_ranks(_through_distributed_state_dict, 2))


def _skip_gives_back(rank, world, bad_step):
    """A non-finite gradient on one replica skips the step (nonfinite="skip"); what each replica sent
    goes back into its momentum when the flags are read (DeMo._give_back, MomentumStorage.restore).
    Against an fp32 momentum handed the same state before every step: the same parameters, and
    after the give-back a momentum within two bf16 steps (at the tensor's largest value) of the fp32
    one: it was rounded twice, after the encode took the sent part out and after the give-back put
    it back, each within one step (the fp32 one's two operations cancel exactly)."""
    pairs = (low, opt_low), (_, opt_ref) = _low_and_ref(**KW)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(bad_step + 1):
        before = [p.detach().clone() for p in low.parameters()]
        _step_realigned(pairs, torch.randn(8, 64, generator=gen), poison=step == bad_step and rank == 1)
    skipped = opt_low.last_step_skipped_by == [1] and opt_ref.last_step_skipped_by == [1]  # reads the flags
    unchanged = all(torch.equal(p, b) for p, b in zip(low.parameters(), before))
    return skipped, unchanged, _params_equal(pairs), _worst_in_bf16_steps(pairs)


def test_a_skipped_steps_give_back_is_rounded_into_the_bf16_momentum():
    for skipped, unchanged, params_equal, worst in run_ranks(_skip_gives_back, 2, 3):
        assert skipped and unchanged and params_equal
        assert worst <= 2.0, worst
