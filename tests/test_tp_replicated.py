"""Parameters tensor parallelism replicates cross the slow link once per replica: 2 replicas x TP 2
on gloo, a column-sharded matrix beside a TP-replicated vector (as a norm weight). Only TP rank 0
sends the vector; after every update both TP ranks hold the same bits of it, and those are the
bits of the same optimizer run on the vector alone, without TP (an independent run: its own
optimizer over a plain tensor)."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from flexdemo import DeMo
from flexdemo.wire.format import FLAG_BYTES
from multiproc import run_ranks

STEPS, ROWS, COLS = 4, 16, 64


def _global_grads(replica, step):
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(ROWS, COLS, generator=g), torch.randn(COLS, generator=g)


def _params(mesh, tp):
    torch.manual_seed(0)
    w, n = torch.randn(ROWS, COLS), torch.randn(COLS)
    rows = ROWS // mesh["tp"].size()
    w_local = w[tp * rows:(tp + 1) * rows].clone()
    return (torch.nn.Parameter(DTensor.from_local(w_local, mesh["tp"], [Shard(0)], run_check=False)),
            torch.nn.Parameter(DTensor.from_local(n.clone(), mesh["tp"], [Replicate()], run_check=False)),
            torch.nn.Parameter(n.clone()))


def _set_grads(w, n, ref, replica, step, tp):
    gw, gn = _global_grads(replica, step)
    rows = ROWS // 2
    w.grad = DTensor.from_local(gw[tp * rows:(tp + 1) * rows].clone(), w.device_mesh, [Shard(0)], run_check=False)
    n.grad = DTensor.from_local(gn.clone(), n.device_mesh, [Replicate()], run_check=False)
    ref.grad = gn.clone()


def _demo(rank, world, overlap, lookahead):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "tp"))
    replica, tp = divmod(rank, 2)
    w, n, ref = _params(mesh, tp)
    kw = dict(lr=0.01, compression_topk=4, compression_chunk=16, overlap=overlap, lookahead=lookahead,
              replicate_group=mesh["replicate"].get_group())
    opt, ref_opt = DeMo([w, n], **kw), DeMo([ref], **kw)
    for step in range(STEPS):
        _set_grads(w, n, ref, replica, step, tp)
        opt.step()
        ref_opt.step()
    return (n.detach().to_local().tolist(), ref.detach().tolist(), "delta" in opt.state[n], opt.payload_bytes_per_step(),
            ref_opt.payload_bytes_per_step())


@pytest.mark.parametrize("overlap, lookahead", [(False, False), (True, False), (True, True)])
def test_demo_sends_a_replicated_parameter_from_one_tp_rank_and_both_hold_its_update(overlap, lookahead):
    results = run_ranks(_demo, 4, overlap, lookahead)
    for rank, (n, ref, has_momentum, sent, ref_sent) in enumerate(results):
        owner = rank % 2 == 0
        assert n == ref, rank  # the bits of the run without TP, on both TP ranks
        assert n != _params_start().tolist(), rank  # and it moved
        assert has_momentum == owner, rank  # its momentum lives on the owner only
        if not owner:  # rank 1 sends all of rank 0's payload but the vector's bytes
            assert results[rank - 1][3] - sent == ref_sent - FLAG_BYTES, (rank, results[rank - 1][3], sent)


def _params_start():
    torch.manual_seed(0)
    torch.randn(ROWS, COLS)
    return torch.randn(COLS)


def _diloco(rank, world, compression):
    from flexdemo.optim.diloco import DiLoCo

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "tp"))
    replica, tp = divmod(rank, 2)
    w, n, ref = _params(mesh, tp)
    inner, ref_inner = torch.optim.SGD([w, n], lr=0.1), torch.optim.SGD([ref], lr=0.1)
    kw = dict(sync_interval=2, compression=compression, topk=4, chunk=16,
              replicate_group=mesh["replicate"].get_group())
    # the outer optimizer holds the vector on every TP rank; a non-owner gives it no gradient
    outer = DiLoCo([("w", w), ("n", n)], outer_optimizer=torch.optim.SGD([w, n], lr=0.7, momentum=0.9, nesterov=True),
                   inner_optimizers=[inner], **kw)
    ref_outer = DiLoCo([("n", ref)], outer_optimizer=torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True),
                       inner_optimizers=[ref_inner], **kw)
    for step in range(2 * kw["sync_interval"]):
        _set_grads(w, n, ref, replica, step, tp)
        for o, i in ((outer, inner), (ref_outer, ref_inner)):
            o.before_inner_step()
            i.step()
            o.after_inner_step()
    return n.detach().to_local().tolist(), ref.detach().tolist(), len(outer.entries)


@pytest.mark.parametrize("compression", ["topk", "dense"])
def test_diloco_syncs_a_replicated_parameter_from_one_tp_rank_and_both_hold_it(compression):
    for rank, (n, ref, entries) in enumerate(run_ranks(_diloco, 4, compression)):
        assert n == ref, rank
        assert entries == (2 if rank % 2 == 0 else 1), rank  # the vector's outer state: on the owner only
