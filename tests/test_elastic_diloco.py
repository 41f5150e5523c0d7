"""The DiLoCo outer step over an elastic replica group when torchft does not commit it (a
replica was lost during the exchange): nothing is applied, the error feedback gets back what
it sent, and the local progress is kept, so the next committed outer step is exactly one
outer step over both cycles. One process; the group is a stand-in whose commits are scripted
(the torchft collectives themselves: tests/test_elastic.py)."""

import torch

from flexdemo.optim.diloco import DiLoCo
from toy_problem import INPUT_NUMEL, loss, make_params, outer_sgd

H = 3


class ScriptedElasticGroup:
    """One replica (the collectives copy), whose commits answer as told."""

    elastic = True

    membership_fixed = False

    def __init__(self, commits):
        self.commits = list(commits)

    def global_ranks(self):
        return [0]

    def wait(self, work, timeout, what):
        pass

    def gather_objects(self, obj):
        return [obj]

    def all_to_all(self, out, mine, out_splits=None, in_splits=None, *, timeout=None, what=""):
        out.copy_(mine)

    def size(self):
        return 1

    def rank(self):
        return 0

    def commit(self):
        return self.commits.pop(0)

    def all_gather(self, out, mine, *, timeout=None, what="", async_op=False):
        out.copy_(mine.unsqueeze(0).expand_as(out))


def _train(params, inner, outer, steps, first_seed=0):
    for s in range(steps):
        outer.before_inner_step()
        x = torch.randn(INPUT_NUMEL, generator=torch.Generator().manual_seed(first_seed + s))
        inner.zero_grad()
        loss(params, x).backward()
        inner.step()
        outer.after_inner_step()


def _diloco(params, inner, sync_interval, group=None, **kw):
    return DiLoCo([(str(i), p) for i, p in enumerate(params)], outer_optimizer=outer_sgd(params, lr=0.7, momentum=0.9),
                  sync_interval=sync_interval, replicate_group=group, inner_optimizers=[inner], **kw)


def test_a_dense_outer_step_not_committed_is_carried_into_the_next_cycle_exactly():
    elastic, plain = make_params(), make_params()
    inner_a, inner_b = torch.optim.AdamW(elastic, lr=1e-2), torch.optim.AdamW(plain, lr=1e-2)
    a = _diloco(elastic, inner_a, H, ScriptedElasticGroup([False, True]))
    b = _diloco(plain, inner_b, 2 * H)  # the reference: one cycle as long as the two
    _train(elastic, inner_a, a, 2 * H)
    _train(plain, inner_b, b, 2 * H)
    assert (a.outer_steps, a.failed_syncs, b.outer_steps) == (1, 1, 1)
    for x, y, ex, ey in zip(elastic, plain, a.entries, b.entries):
        assert torch.equal(x, y)
        assert torch.equal(ex.global_copy, ey.global_copy) and torch.equal(ex.momentum, ey.momentum)


def test_a_topk_outer_step_not_committed_changes_nothing_but_keeps_the_pseudo_gradient():
    params = make_params()
    start = [p.detach().clone() for p in params]
    inner = torch.optim.AdamW(params, lr=1e-2)
    outer = _diloco(params, inner, H, ScriptedElasticGroup([False, True]), compression="topk", topk=8, chunk=16,
                    value_encoding="fp32", decay=0.5)
    _train(params, inner, outer, H)
    assert (outer.outer_steps, outer.failed_syncs, outer.last_sync_committed) == (0, 1, False)
    for p, p0, e in zip(params, start, outer.entries):
        assert not torch.equal(p, p0)  # the cycle's progress is kept, not rolled back
        assert torch.equal(e.global_copy, p0) and not e.momentum.any()
        # what was sent came back: the error feedback is the whole pseudo-gradient again
        torch.testing.assert_close(e.error_feedback, p0 - p.detach(), rtol=0, atol=1e-6)
    _train(params, inner, outer, H, first_seed=H)
    assert (outer.outer_steps, outer.last_sync_committed) == (1, True)
    assert any(not torch.equal(e.global_copy, p0) for e, p0 in zip(outer.entries, start))
