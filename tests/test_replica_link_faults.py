"""A stalled peer on the replica link: the exchange stops within the configured time with an
error naming the replica group, instead of hanging (gloo, 2 replicas)."""

import time

import pytest
import torch

from flexdemo import DeMo
from flexdemo.optim.diloco import DiLoCo
from multiproc import run_ranks
from toy_problem import make_params, outer_sgd

TIMEOUT = 2.0
STALL = 12.0


def _stalled_peer(rank, world, which):
    params = make_params()
    for p in params:
        p.grad = torch.ones_like(p)
    if which == "demo":
        opt = DeMo(params, lr=0.01, exchange_timeout=TIMEOUT)
        step = opt.step
    else:
        opt = DiLoCo([(str(i), p) for i, p in enumerate(params)], outer_optimizer=outer_sgd(params), sync_interval=1,
                     exchange_timeout=TIMEOUT, compression="dense", inner_optimizers=())
        step = opt.sync
    if rank == 1:
        time.sleep(STALL)  # the peer across the slow link never shows up in time
        return None
    start = time.perf_counter()
    try:
        step()
    except Exception as e:
        return type(e).__name__, str(e), time.perf_counter() - start
    return "no error", "", time.perf_counter() - start


@pytest.mark.parametrize("which", ["demo", "dense_diloco"])
def test_a_stalled_peer_times_out_naming_the_replica_group(which):
    name, message, elapsed = run_ranks(_stalled_peer, 2, which, timeout=STALL + 60)[0]
    assert name == "ReplicaExchangeTimeout", message
    assert "over the replica group (ranks [0, 1]) did not complete within 2 s" in message
    assert elapsed < TIMEOUT + 5
