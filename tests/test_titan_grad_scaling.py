"""In mode "demo" each replica must see its own replica-mean gradient (before clipping):
the replica average of demo grads equals stock HSDP's gradient, exactly up to fp32 noise."""

import os
import subprocess
import sys

from titan_launch import REPO, free_port

WORKER = REPO / "tests" / "titan_scaling_worker.py"


def _run(skip_scaling: bool):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "SKIP_SCALING": "1" if skip_scaling else "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), str(WORKER)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_demo_grads_are_replica_mean():
    proc = _run(skip_scaling=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("worst relative error") == 4


def test_check_detects_missing_scaling():
    # Negative control: without the rescale the replica average is half HSDP's grad.
    proc = _run(skip_scaling=True)
    assert proc.returncode != 0
