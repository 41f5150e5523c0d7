"""Tensor parallelism inside a replica, end to end on CPU: 4 gloo processes = 2 replicas x TP 2
(torchtitan's llama3 TP plan, sequence parallel), launched by scripts/launch.sh, in each mode
that keeps replicas apart. Each rank exchanges its own TP shard with the rank holding the same
shard in the other replica (the dp_replicate group).

Mode "off" (torchtitan's HSDP) takes TP only beside FSDP (with one shard it replicates through
DDP, which refuses TP): tests/test_titan_bad_configs.py checks that it says so before starting.
"""

import math

import pytest

from titan_launch import CONFIGS, check_loss_falls, launch

STEPS, CKPT_STEP = 10, 5
TP2 = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2")
RUN_TIMEOUT = 400
BF16_MOMENTUM = ("--flexdemo.momentum_dtype", "bfloat16")


def _tp_run(mode: str, dump, assets, *extra):
    config = CONFIGS / ("cpu_2x2_flexdemo.toml" if mode == "demo" else f"cpu_2x2_{mode}.toml")
    return launch(config, dump, "--training.steps", str(STEPS), "--flexdemo.replica_check_interval",
                  "5", *TP2, *extra, assets=assets, timeout=RUN_TIMEOUT)


@pytest.fixture(scope="module")
def demo_tp_run(tmp_path_factory, assets):
    # bf16 momentum here (its rounding follows each element's place in the whole tensor, so the
    # resume on another layout below continues it)
    run = _tp_run("demo", tmp_path_factory.mktemp("demo_tp"), assets, "--checkpoint.enable",
                  "--checkpoint.interval", str(CKPT_STEP), *BF16_MOMENTUM)
    assert run.returncode == 0, run.output[-6000:]
    return run


def _replicas_identical(run, steps):
    """rank = replica x 2 + TP rank: the same TP shard of both replicas holds the same bits."""
    d = run.digests()
    for step in steps:
        for tp in (0, 1):
            assert (tp, step) in d and d[(tp, step)] == d[(2 + tp, step)], (step, tp, d)
        assert d[(0, step)] != d[(1, step)]  # the two TP ranks hold different shards


def test_demo_with_tensor_parallelism_trains_and_keeps_replicas_identical(demo_tp_run):
    losses = demo_tp_run.losses(0)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    check_loss_falls("demo, TP 2", losses, 0.2)
    _replicas_identical(demo_tp_run, (CKPT_STEP, STEPS))
    # Each TP rank sends its own shard's payload, every step; the norms (TP-replicated) only TP
    # rank 0 sends, so TP rank 1 sends less, and a TP position sends alike in both replicas.
    sent = {rank: [x[0] for s, x in sorted(demo_tp_run.exchange(rank).items())] for rank in range(4)}
    for rank in range(4):
        assert len(sent[rank]) == STEPS and min(sent[rank]) > 0, (rank, sent[rank])
    assert sent[0] == sent[2] and sent[1] == sent[3], sent
    assert all(a > b for a, b in zip(sent[0], sent[1])), sent


@pytest.mark.parametrize("mode", ["diloco", "demo_diloco"])
def test_diloco_modes_with_tensor_parallelism(mode, tmp_path, assets):
    run = _tp_run(mode, tmp_path / mode, assets)
    assert run.returncode == 0, run.output[-6000:]
    losses = run.losses(0)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    _replicas_identical(run, (5, 10))  # right after each outer step (sync_interval 5)


def test_a_tensor_parallel_checkpoint_resumes_without_it(demo_tp_run, tmp_path, assets):
    """DCP reshards the parameters and DeMo's (bf16) momentum from TP 2 to whole tensors: 2 replicas x 1
    process, the same data-parallel ranks and batches. The first resumed step's loss is the
    uninterrupted run's up to rounding (the same parameters; the matmuls sum in another order),
    and training goes on."""
    import shutil

    dump = tmp_path / "resumed"
    shutil.copytree(demo_tp_run.dump / "checkpoint" / f"step-{CKPT_STEP}",
                    dump / "checkpoint" / f"step-{CKPT_STEP}")
    run = launch(CONFIGS / "cpu_2x2_flexdemo.toml", dump, "--training.steps", str(STEPS),
                 "--flexdemo.replica_check_interval", str(CKPT_STEP), "--parallelism.data_parallel_shard_degree",
                 "1", "--checkpoint.enable", "--checkpoint.interval", str(STEPS), *BF16_MOMENTUM, assets=assets,
                 timeout=RUN_TIMEOUT, nproc=2)
    assert run.returncode == 0, run.output[-6000:]
    resumed, uninterrupted = run.losses(0), demo_tp_run.losses(0)
    assert sorted(resumed) == list(range(CKPT_STEP + 1, STEPS + 1)), resumed
    assert resumed[CKPT_STEP + 1] == pytest.approx(uninterrupted[CKPT_STEP + 1], rel=1e-4)
    # The momentum came along: the next steps' losses stay with the uninterrupted run's (a
    # momentum dropped at the resume moved step 9 by 0.11 here).
    for step in range(CKPT_STEP + 2, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=0.02), (step, resumed, uninterrupted)


def test_the_70b_node_plan_starts_on_cpu_with_a_tiny_flavor(tmp_path, assets):
    """train_configs/multinode_llama3_70b_flexdemo.toml as shipped (TP inside the node, one replica
    per node, no FSDP), shrunk only in size: the debug flavor, TP 2, short sequences, 3 steps."""
    config = CONFIGS / "multinode_llama3_70b_flexdemo.toml"
    run = launch(config, tmp_path, "--model.flavor", "debugmodel_2layer", "--parallelism.tensor_parallel_degree", "2",
                 "--training.dataset", "flexdemo_stdlib", "--validation.dataset", "flexdemo_stdlib_validation",
                 "--training.seq_len", "128", "--validation.seq_len", "128", "--training.steps", "3",
                 "--validation.freq", "3", "--validation.steps", "1", "--checkpoint.no_enable",
                 "--flexdemo.replica_check_interval", "3", "--metrics.log_freq", "1",
                 assets=assets, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    assert sorted(run.losses(0)) == [1, 2, 3]
    assert 3 in run.validation_losses(0)
    _replicas_identical(run, (3,))
    assert "fsdp 1 x tp 2" in run.output  # the memory line: the layout the template sets
