"""In mode "demo" each replica must hold its own replica-mean gradient before clipping:
the replica average of the gradients equals the full-batch mean gradient.  Checked with
FSDP inside each replica (2x2) and without FSDP (2x1: tensor-hook path). Both changes, and
the broadcast that makes replicas start identical, are made by flexdemo's parallelize once the
weights exist."""

import os
import subprocess
import sys

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from titan_launch import REPO, free_port

WORKER = REPO / "tests" / "titan_scaling_worker.py"


def _run(shards: int, skip_scaling: bool = False):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "SHARDS": str(shards), "SKIP_SCALING": "1" if skip_scaling else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(2 * shards),
           "--master_port", str(free_port()), str(WORKER)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("shards", [2, 1])
def test_demo_grads_are_replica_mean(shards):
    proc = _run(shards)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("worst relative error") == 2 * shards
    # and the replicas, initialised from different seeds, start identical (init_sync broadcast)
    assert proc.stdout.count("tensors differing between replicas after init: 0") == 2 * shards, proc.stdout


def test_check_detects_missing_scaling():
    # Negative control: without the rescale the replica average is half the mean grad.
    proc = _run(shards=1, skip_scaling=True)
    assert proc.returncode != 0
    assert "worst relative error 5.000e-01" in proc.stdout
    assert "tensors differing between replicas after init: 0" not in proc.stdout  # no broadcast either
