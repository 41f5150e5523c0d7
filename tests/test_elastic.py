"""Elastic replicas on torchft, end to end on CPU: a real Lighthouse (scripts/lighthouse.sh), three
replica processes (tests/elastic_worker.py: DeMo over flexdemo.elastic.ElasticGroup), one killed
with SIGKILL and started again.

What must hold: the survivors go on without it (each step's mean over the two of them), the
restarted replica heals from a live peer instead of starting over, and from its first step back
its parameters are bit for bit the survivors' at every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(path: Path, step: int, deadline: float) -> None:
    while time.time() < deadline:
        rows = _lines(path)
        if rows and rows[-1]["step"] >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"{path.name} did not reach step {step} in time")


@pytest.fixture
def lighthouse():
    port = free_port()
    env = {**os.environ, "HEARTBEAT_TIMEOUT_MS": "1500"}
    p = subprocess.Popen(["bash", str(REPO / "scripts" / "lighthouse.sh"), str(port), "2"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    yield f"http://localhost:{port}"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("exchange", ["allgather", "sharded"])  # sharded: the owners' split follows the count
def test_a_killed_replica_is_dropped_and_rejoins_bitwise_equal(lighthouse, tmp_path, exchange):
    steps = 60
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1", "ELASTIC_STEP_PAUSE": "0.25",
           "ELASTIC_EXCHANGE": exchange, "ELASTIC_START_BARRIER": f"{tmp_path}:3"}

    def start(replica: int, log: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(REPO / "tests" / "elastic_worker.py"), str(replica),
                                 str(steps), str(log)], env=env, stdout=open(log.with_suffix(".out"), "w"),
                                stderr=subprocess.STDOUT)

    logs = [tmp_path / f"replica{r}.jsonl" for r in range(3)]
    procs = [start(r, logs[r]) for r in range(3)]
    deadline = time.time() + 200
    try:
        _wait_for_step(logs[2], 8, deadline)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        killed_at = _lines(logs[2])[-1]["step"]
        _wait_for_step(logs[0], killed_at + 10, deadline)
        rejoined_log = tmp_path / "replica2_again.jsonl"
        procs[2] = start(2, rejoined_log)
        for p in procs:
            assert p.wait(timeout=max(1, deadline - time.time())) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    a, b, before, after = _lines(logs[0]), _lines(logs[1]), _lines(logs[2]), _lines(rejoined_log)
    by_step = {r["step"]: r for r in a}
    assert [r["step"] for r in a] == list(range(1, steps + 1)) == [r["step"] for r in b]
    assert all(r["applied"] for r in a + b)
    # The two survivors agree at every step; the killed replica agreed up to its death.
    assert [r["digest"] for r in a] == [r["digest"] for r in b]
    assert all(by_step[r["step"]]["digest"] == r["digest"] for r in before)
    # They went on without it: steps whose mean had two replicas, not three.
    outage = [r["step"] for r in a if r["participants"] == 2]
    assert len(outage) >= 5 and min(outage) > killed_at
    # It came back healed (its first step is the survivors' next one, not step 1) and equal to
    # them, bit for bit, from that step on, counted among the participants again.
    assert after and after[0]["step"] > killed_at + 5
    assert after[-1]["step"] == steps
    for r in after:
        assert r["digest"] == by_step[r["step"]]["digest"], f"step {r['step']}"
        assert r["participants"] == by_step[r["step"]]["participants"] == 3


@pytest.mark.timeout(120)
def test_the_dense_replica_mean_over_torchft_is_the_same_bits_everywhere(lighthouse, tmp_path):
    # DiLoCo's dense exchange over torchft's all_to_all and all_gather: every replica receives
    # the fp32 mean of both inputs, bit for bit, however torchft ranked the two.
    import torch

    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"replica{r}.pt" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "elastic_mean_worker.py"), str(r), str(outs[r])],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"r{r}.err", "w"))
             for r in range(2)]
    try:
        codes = [p.wait(timeout=100) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], (tmp_path / "r0.err").read_text()[-2000:]
    a, b = (torch.load(o) for o in outs)
    expected = (a["input"] + b["input"]) / 2
    for r in (a, b):
        assert r["participants"] == 2 and r["committed"]
        assert torch.equal(r["mean"], expected)
        assert r["received"] > 0
