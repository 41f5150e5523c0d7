"""DeMo on FSDP2 DTensor shards: sharded == unsharded, and uneven/empty shards vs the reference."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from flexdemo import DeMo
from fsdp_toy import replica_mesh as _mesh, shard_layers as _shard, toy_mlp as _mlp
from multiproc import run_ranks
from reference_demo import ReferenceDeMo, agrees_then_realign


def _sharded_vs_unsharded(rank, world, encoding, steps):
    mesh = _mesh(2, 2)
    replica = mesh["replicate"].get_local_rank()
    sharded = _shard(_mlp(0), mesh["shard"])
    plain = _mlp(0)
    kw = dict(lr=0.01, compression_decay=0.95, compression_topk=16, compression_chunk=64, value_encoding=encoding,
              replicate_group=mesh["replicate"].get_group())
    opt_sharded = DeMo(sharded.parameters(), **kw)
    opt_plain = DeMo(plain.parameters(), **kw)
    gen = torch.Generator().manual_seed(100 + replica)  # same data on both shards of a replica
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(8, 64, generator=gen)
        for model, opt in ((sharded, opt_sharded), (plain, opt_plain)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for ps, pp in zip(sharded.parameters(), plain.parameters()):
            worst = max(worst, float((ps.full_tensor() - pp).abs().max()))
    states_are_dtensors = all(
        isinstance(opt_sharded.state[p]["delta"], DTensor) and opt_sharded.state[p]["delta"].placements == p.placements
        for p in sharded.parameters()
    )
    moved = sum(float((a.detach() - b.detach()).abs().sum()) for a, b in zip(plain.parameters(), _mlp(0).parameters()))
    return worst, states_are_dtensors, moved, opt_sharded.last_step_bytes_sent, opt_plain.last_step_bytes_sent


def test_sharded_equals_unsharded_fp32():
    for worst, dtensor_states, moved, sent_sharded, sent_plain in run_ranks(_sharded_vs_unsharded, 4, "fp32", 20):
        assert worst == 0.0, f"sharded and unsharded parameters differ by {worst}"
        assert dtensor_states
        assert moved > 0
        assert 0 < sent_sharded < sent_plain  # each shard sends only its own blocks


class _Odd(nn.Module):
    """Parameters whose rows do not divide by the shard count, one of them leaving a shard empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(5, 3)  # rows 3 -> shards of 2 and 1
        self.b = nn.Parameter(torch.randn(1, 70))  # shard 1 gets 0 rows
        self.c = nn.Parameter(torch.randn(131, 66))  # prime-ish rows, uneven

    def forward(self, x):
        h = torch.tanh(self.a(x[:, :5]))
        return (h.sum() * self.b).sum() + torch.tanh(self.c * x[:1, :1]).sum()


def _uneven_vs_reference(rank, world, steps):
    mesh = _mesh(2, 2)
    replica = mesh["replicate"].get_local_rank()
    model = _Odd()
    fully_shard(model, mesh=mesh["shard"])
    model.set_force_sum_reduction_for_comms(True)
    group = mesh["replicate"].get_group()
    opt = DeMo(model.parameters(), lr=0.01, compression_decay=0.9, compression_topk=4, value_encoding="fp32",
               replicate_group=group)
    params = list(model.parameters())
    local = [p.to_local() for p in params]
    shapes = [tuple(t.shape) for t in local]
    nonempty = [i for i, t in enumerate(local) if t.numel()]
    ref_params = [local[i].detach().clone() for i in nonempty]
    reference = ReferenceDeMo(ref_params, lr=0.01, decay=0.9, topk=4, chunk=64, weight_decay=0.0, encoding="fp32",
                              group=group)
    gen = torch.Generator().manual_seed(7 + replica)
    mismatches = 0
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).backward()
        for i, rp in zip(nonempty, ref_params):
            rp.grad = params[i].grad.to_local().clone()
        opt.step()
        reference.step()
        # One kept coefficient per small block (top-4 of a 64 x 64 block, scaled to its share)
        # decodes to cosines that are exactly zero at some elements in exact arithmetic; there each
        # implementation takes the sign of its own rounding: only those may differ.
        ours = [params[i].to_local() for i in nonempty]
        mismatches += not agrees_then_realign(ours, ref_params, reference.last_decoded)
    full = [p.full_tensor() for p in params]
    return shapes, mismatches, [f.sum().item() for f in full]


def test_uneven_and_empty_shards_match_reference_on_local_shards():
    results = run_ranks(_uneven_vs_reference, 4, 12)
    shapes = [r[0] for r in results]
    assert (0, 70) in shapes[1] + shapes[3], "expected an empty local shard"
    assert (2, 5) in shapes[0] and (1, 5) in shapes[1]
    for _, mismatches, _ in results:
        assert mismatches == 0
    # Both replicas end with the same full parameters.
    assert results[0][2] == results[1][2] == results[2][2] == results[3][2]
