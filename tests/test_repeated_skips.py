"""Mode demo's stop for a fault that repeats, in flexdemo's torchtitan optimizer container:
``max_consecutive_skips`` steps in a row skipped for a non-finite gradient stop every rank at the
same step with an error naming the replica and the parameter; skips in a row only count; every
skipped step is counted in the metrics; a rank that learns of a skip a step late (DeMo on a
GPU reads the flags when the next step starts) stops at the same step as the others."""

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

import torch
import torch.distributed as dist
import torch.nn as nn

from flexdemo import DeMo
from flexdemo.optim.diloco import RepeatedSkipsError
from flexdemo.run_settings import RunSettings
from flexdemo.section import FlexDemo
from flexdemo.titan.optimizer import FlexOptimizersContainer
from multiproc import run_ranks

STEPS = 12
SKIPPED = "replica_exchange/skipped_steps"


def _model():
    torch.manual_seed(0)  # every replica starts identical
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def _container(model, cls, kwargs, limit):
    return FlexOptimizersContainer(
        [model], cls, kwargs, replicate_group=dist.group.WORLD, replica_check_interval=0,
        modelled_bytes_per_step=None, per_replica_state=True, run_settings=RunSettings(FlexDemo()),
        format_key="test", last_step=STEPS,
        max_consecutive_skips=limit,
    )


def _train(rank, world, bad_steps, limit):
    model = _model()
    opts = _container(model, DeMo, {"lr": 1e-3, "compression_topk": 8}, limit)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    counted = {}
    for step in range(1, STEPS + 1):
        opts.zero_grad()
        model(x).square().mean().backward()
        if rank == 1 and step in bad_steps:
            model[2].weight.grad[0, 5] = float("nan")
        try:
            opts.step()
        except RepeatedSkipsError as e:
            return "stopped", step, str(e), counted
        counted[step] = opts.exchange_stats()[SKIPPED]
    return "ran on", STEPS, "", counted


def test_a_fault_every_step_stops_every_rank_naming_replica_and_parameter():
    bad = {2, 3, *range(5, STEPS + 1)}
    for how, step, msg, counted in run_ranks(_train, 2, bad, 3):
        # Steps 5, 6, 7 are three in a row; every rank knows it for sure after step 8.
        assert how == "stopped" and step == 8, (how, step, counted)
        assert "3 steps in a row (5..7) skipped on every replica (max_consecutive_skips = 3)" in msg, msg
        assert "a non-finite gradient on replica(s) [1]" in msg, msg
        assert "at step 8 non-finite gradients on replica 1 (2.weight)" in msg, msg
        assert counted == {1: 0, 2: 1, 3: 2, 4: 2, 5: 3, 6: 4, 7: 5}  # the metric, cumulative


@pytest.mark.parametrize("bad,limit", [({2, 3, 5, 6, 8, 9}, 3), (set(range(1, STEPS + 1)), 0)])
def test_skips_not_in_a_row_or_no_limit_run_on(bad, limit):
    for how, _, _, counted in run_ranks(_train, 2, bad, limit):
        assert how == "ran on" and counted[STEPS] == len(bad), counted


class _LateReports(torch.optim.SGD):
    """Stands in for DeMo's reporting: the steps in ``skipped`` are reported skipped by replica
    1, ``lag`` steps after they ran (``wait``: at once), as pop_skipped_steps does."""

    def __init__(self, params, lr, skipped, lag):
        super().__init__(params, lr=lr)
        self.steps, self.skipped, self.lag = 0, set(skipped), lag

    def step(self, closure=None):
        self.steps += 1

    def pop_skipped_steps(self, wait=False):
        known = self.steps - (0 if wait else self.lag)
        ready = sorted(s for s in self.skipped if s <= known)
        self.skipped -= set(ready)
        return [(self.steps - s, [1]) for s in ready]


def _late(rank, world):
    model = _model()
    opts = _container(model, _LateReports, {"lr": 0.0, "skipped": range(3, STEPS + 1), "lag": rank}, 3)
    for step in range(1, STEPS + 1):
        try:
            opts.step()
        except RepeatedSkipsError as e:
            return step, str(e)
    return None, ""


def test_a_rank_that_learns_late_stops_at_the_same_step():
    (step0, msg0), (step1, msg1) = run_ranks(_late, 2)
    assert step0 == step1 == 6, (step0, step1)  # 3, 4, 5 in a row, known everywhere after step 6
    assert msg0 == msg1 and "(3..5)" in msg0 and "step 6's gradients are finite" in msg0, msg0


@pytest.mark.parametrize("value", [-1, 2.5, True, "3"])
def test_the_config_key_is_a_count(value):
    from flexdemo.titan.config import FlexDemo, FlexDemoConfigError, check_section

    check_section(FlexDemo(max_consecutive_skips=0))  # 0: never stop
    with pytest.raises(FlexDemoConfigError, match=f"max_consecutive_skips={value!r}"):
        check_section(FlexDemo(max_consecutive_skips=value))
