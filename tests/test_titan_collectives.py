"""Which collectives cross the replica dimension (the slow link) in one training step,
counted by a dispatch mode around torchtitan's own train_step on 4 CPU ranks (2 replicas x
2 FSDP shards; rank = replica * 2 + shard). flexdemo's FlexTrainer keeps torchtitan's token
count inside a replica: per-step mode sends ONE collective over the replica group per step,
and a DiLoCo inner step none."""

import json
import os
import subprocess
import sys

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from titan_launch import CONFIGS, REPO, free_port

WORKER = REPO / "tests" / "titan_collectives_worker.py"


def _collectives(trainer, config, steps, *overrides, assets):
    args = ["--job.config_file", str(CONFIGS / config), "--model.hf_assets_path", str(assets),
            "--metrics.log_freq", "100", "--training.steps", str(max(steps)), *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRAINER": trainer,
           "ARGS": " ".join(args), "RECORD_STEPS": ",".join(map(str, steps))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), str(WORKER)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = {step: [] for step in steps}
    for line in proc.stdout.splitlines():
        if line.startswith("COLLECTIVE "):
            _, step, op, ranks = line.split(" ", 3)
            out[int(step)].append((op, json.loads(ranks)))
    assert all(out.values()), out  # every step did communicate (inside a replica at least)
    return out


def _crossing_replicas(collectives):
    """Collectives whose group holds ranks of both replicas (rank // 2 = replica)."""
    return [(op, ranks) for op, ranks in collectives if len({r // 2 for r in ranks}) > 1]


def test_per_step_mode_sends_one_collective_over_the_replicas(tmp_path, assets):
    flex = _collectives("flex", "cpu_2x2_flexdemo.toml", [3], "--job.dump_folder", str(tmp_path / "a"),
                        assets=assets)[3]
    assert _crossing_replicas(flex) == [("c10d._allgather_base_.default", [0, 2])]  # DeMo's exchange
    # torchtitan's own Trainer all-reduces the step's token count over all 4 ranks as well.
    stock = _collectives("stock", "cpu_2x2_flexdemo.toml", [3], "--job.dump_folder", str(tmp_path / "b"),
                         assets=assets)[3]
    assert sorted(_crossing_replicas(stock)) == sorted(
        [("c10d._allgather_base_.default", [0, 2]), ("_c10d_functional.all_reduce.default", [0, 1, 2, 3])])


@pytest.mark.parametrize("config", ["cpu_2x2_diloco.toml"])
def test_diloco_inner_steps_send_nothing_over_the_replicas(tmp_path, assets, config):
    steps = _collectives("flex", config, [3, 4], "--flexdemo.sync_interval", "4",
                         "--flexdemo.replica_check_interval", "0", "--job.dump_folder", str(tmp_path),
                         assets=assets)
    assert _crossing_replicas(steps[3]) == []  # an inner step
    # The outer step: the dense mean's all_to_all and all_gather over the replica group.
    assert sorted(op for op, _ in _crossing_replicas(steps[4])) == [
        "c10d._allgather_base_.default", "c10d.alltoall_base_.default"]
