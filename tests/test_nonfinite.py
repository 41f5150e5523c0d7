"""A non-finite gradient on one replica (or on one shard of a replica): found before anything is
sent, agreed through the exchange's flag byte, and every replica skips the step alike or stops;
nothing non-finite reaches a parameter, a momentum, or another replica."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from flexdemo import DeMo
from flexdemo.compression.exchange import any_nonfinite
from flexdemo.optim.demo import NonFiniteGradientError
from multiproc import run_ranks
from toy_problem import all_ranks_equal, backward_on, make_params, outer_sgd

LR, WD, DECAY, BAD_STEP = 0.01, 0.1, 0.9, 2


def _grads(params, rank, step):
    backward_on(params, 100 * rank + step)


def _skip(rank, world, overlap, deferred=False, check_momentum=True):
    # deferred: the flags' copy to the host never reports ready, so the step learns of the skip
    # only when it must (the next step, state_dict), through pop_skipped_steps, as a trainer does.
    # check_momentum: read the momentum after the flagged step (through state_dict).
    if deferred:
        from flexdemo.compression import compressor

        compressor.HostFlags.ready = lambda self: False
    params = make_params()
    opt = DeMo(params, lr=LR, weight_decay=WD, compression_decay=DECAY, compression_topk=8, overlap=overlap,
               value_encoding="fp32")
    skipped, checks = [], []
    for step in range(5):
        _grads(params, rank, step)
        if step == BAD_STEP and rank == 1:
            params[2].grad[3, 7] = float("nan")
        before = [p.detach().clone() for p in params]
        deltas = [opt.state[p]["delta"].clone() if p in opt.state else torch.zeros_like(p) for p in params]
        grads = [torch.zeros_like(p) if (step == BAD_STEP and rank == 1) else p.grad.clone() for p in params]
        opt.step()
        if deferred:
            skipped.append([])
            for ago, replicas in opt.pop_skipped_steps():
                skipped[-1 - ago] = replicas
        else:
            skipped.append(opt.last_step_skipped_by)
        if step == (BAD_STEP + 1 if overlap else BAD_STEP):
            # Nobody applied the flagged update: with overlap this step applied nothing but its decay.
            applied_nothing = all(torch.equal(p, b * (1 - LR * WD)) for p, b in zip(params, before))
            checks.append(applied_nothing)
        if step == BAD_STEP and not overlap and check_momentum:
            # The momentum kept this step's gradient (the one that saw NaN: none), nothing was lost.
            expected = [d * DECAY + LR * g for d, g in zip(deltas, grads)]
            opt.state_dict()  # (deferred: it puts the skipped step's payload back first)
            worst = max(float((opt.state[p]["delta"] - e).abs().max() / e.abs().max())
                        for p, e in zip(params, expected))
            checks.append(worst < 1e-5)
        assert all(torch.isfinite(p).all() and torch.isfinite(opt.state[p]["delta"]).all() for p in params)
        assert all_ranks_equal(params)
    if deferred:
        for ago, replicas in opt.pop_skipped_steps(wait=True):
            skipped[-1 - ago] = replicas
    # The end state as bytes: tensors through the result queue are shared by file descriptor, which
    # can vanish with the rank's process before the parent reads them.
    return (skipped, checks, [p.detach().numpy().tobytes() for p in params],
            [opt.state[p]["delta"].numpy().tobytes() for p in params])


@pytest.mark.parametrize("overlap", [False, True])
def test_every_replica_skips_the_step_alike(overlap):
    flagged_step = BAD_STEP + 1 if overlap else BAD_STEP  # overlap learns it one step later
    for skipped, checks, _, _ in run_ranks(_skip, 2, overlap):
        assert skipped == [[1] if s == flagged_step else [] for s in range(5)]
        assert checks and all(checks), checks


@pytest.mark.parametrize("check_momentum", [True, False])
def test_a_skip_learned_late_ends_the_same(check_momentum):
    # Nothing waits for the flags in a step (nonfinite="skip"): learned late, the skipped
    # payload is put back before the momentum is next read (by state_dict, or else by the next
    # step's encode), and the run ends bitwise as when the flags are read at once.
    at_once, late = run_ranks(_skip, 2, False), run_ranks(_skip, 2, False, True, check_momentum)
    for (skipped, checks, params, deltas), (skipped_l, checks_l, params_l, deltas_l) in zip(at_once, late):
        assert skipped_l == skipped == [[1] if s == BAD_STEP else [] for s in range(5)]
        assert all(checks_l) and len(checks_l) == 1 + check_momentum, checks_l
        assert params + deltas == params_l + deltas_l  # bitwise


def _stop(rank, world):
    params = make_params()
    opt = DeMo(params, lr=LR, nonfinite="stop")
    opt.param_names = {id(p): f"layer{i}.weight" for i, p in enumerate(params)}
    _grads(params, rank, 0)
    if rank == 1:
        params[2].grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    except NonFiniteGradientError as e:
        return str(e), all(torch.equal(p, b) for p, b in zip(params, before))
    return "no error", False


def test_stop_raises_on_every_replica_naming_the_parameter():
    (msg0, same0), (msg1, same1) = run_ranks(_stop, 2)
    assert "a non-finite gradient on replica(s) [1]" in msg0 and "here in" not in msg0
    assert "a non-finite gradient on replica(s) [1]; here in layer2.weight" in msg1
    assert same0 and same1  # no parameter moved


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128))


def _step_with_a_nan_on_rank_1(rank, mesh, model, replica):
    """One DeMo step of the sharded ``model`` with a NaN in one gradient of rank 1's shard only:
    (the replicas that skipped, whether every local parameter stayed as it was)."""
    model.set_force_sum_reduction_for_comms(True)
    opt = DeMo(model.parameters(), lr=LR, replicate_group=mesh["replicate"].get_group())
    model(torch.randn(4, 64, generator=torch.Generator().manual_seed(replica))).square().mean().backward()
    if rank == 1:
        model[2].weight.grad.to_local()[0, 0] = float("nan")
    before = [p.to_local().clone() for p in model.parameters()]
    opt.step()
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
    return opt.last_step_skipped_by, unchanged


def _sharded(rank, world):
    # rank 1 is replica 0, shard 1: the other shard of that replica never sees the NaN
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model()
    fully_shard(model, mesh=mesh["shard"])
    return _step_with_a_nan_on_rank_1(rank, mesh, model, rank // 2)


def test_one_bad_shard_skips_the_step_for_every_shard_and_replica():
    for skipped_by, unchanged in run_ranks(_sharded, 4):
        assert skipped_by == [0]  # replica 0 flagged it, in every shard group
        assert unchanged


def _sharded_and_tp(rank, world):
    # 2 replicas of FSDP 2 x TP 2: a replica's shards span a 2-D mesh, rows and columns. Rank 1
    # is replica 0, FSDP shard 0, TP rank 1: neither its row nor its column holds (fsdp 1, tp 0)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "fsdp", "tp"))
    model = _model()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["fsdp"])
    return _step_with_a_nan_on_rank_1(rank, mesh, model, rank // 4)


def test_one_bad_shard_of_an_fsdp_by_tp_replica_skips_the_step_everywhere():
    for skipped_by, unchanged in run_ranks(_sharded_and_tp, 8):
        assert skipped_by == [0]
        assert unchanged


def _diloco(rank, world, compression, encoding):
    from flexdemo.optim.diloco import DiLoCo

    params = make_params()
    inner = torch.optim.SGD(params, lr=0.1)
    outer = DiLoCo([(str(i), p) for i, p in enumerate(params)], outer_optimizer=outer_sgd(params), sync_interval=1,
                   compression=compression, value_encoding=encoding, topk=8, inner_optimizers=[inner])
    results = []
    for cycle in range(3):
        outer.before_inner_step()
        global_before = [e.global_copy.clone() for e in outer.entries]
        ef_before = [e.error_feedback.clone() if e.error_feedback is not None else None for e in outer.entries]
        _grads(params, rank, cycle)
        inner.step()
        if cycle == 1 and rank == 1:
            with torch.no_grad():
                params[0][5, 5] = float("nan")  # this replica's cycle blew up
        pseudo_grads = [g - p.detach() for g, p in zip(global_before, params)]
        outer.after_inner_step()
        skipped = outer.last_sync_skipped
        # Skipped: the global copy kept, every replica back on it; nothing non-finite anywhere.
        kept = all(torch.equal(e.global_copy, g) for e, g in zip(outer.entries, global_before))
        on_global = all(torch.equal(p, e.global_copy) for p, e in zip(params, outer.entries))
        finite = all(torch.isfinite(e.global_copy).all() for e in outer.entries) and all(
            torch.isfinite(p).all() for p in params)
        ef_ok = True
        if skipped and compression == "topk":
            # Error feedback keeps what it had (decayed) plus this cycle's pseudo-gradient, which
            # counts as zero where it was not finite: what it sent came back.
            expected = [0.9 * f + (0 if rank == 1 else g) for f, g in zip(ef_before, pseudo_grads)]
            ef_ok = all(float((e.error_feedback - x).abs().max()) <= 1e-5 * float(x.abs().max()) + 1e-12
                        for e, x in zip(outer.entries, expected))
        results.append((skipped, kept, on_global, finite, ef_ok, all_ranks_equal(params)))
    return results


@pytest.mark.parametrize("compression,encoding", [("dense", "bf16"), ("topk", "scaled_sign")])
def test_diloco_discards_a_cycle_that_blew_up(compression, encoding):
    for results in run_ranks(_diloco, 2, compression, encoding):
        assert [r[0] for r in results] == [False, True, False]
        skipped = results[1]
        assert skipped[1] and skipped[2] and skipped[3] and skipped[4] and skipped[5]
        assert all(r[3] and r[5] for r in results)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_the_local_check_finds_any_nonfinite_value_and_no_large_finite_one(bad):
    # Large finite values whose squares overflow must not count: the check is max |x|, not a norm.
    tensors = [torch.full((4, 3), 3e38), torch.zeros(0), torch.randn(5, 7).bfloat16(), torch.randn(9)]
    if bad is not None:
        tensors[2][4, 6] = bad
    assert any_nonfinite(tensors, (), torch.device("cpu")) == (bad is not None)
    assert not any_nonfinite([], (), torch.device("cpu"))
