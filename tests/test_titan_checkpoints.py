"""Checkpoints that move (CPU, torchtitan through scripts/launch.sh): a per-step run resumed
on 4 replicas x 1 shard and back on 2 x 2; optimizers switched through a model-only
checkpoint in both directions; a checkpoint of other settings refused before any rank starts."""

import shutil

import pytest

from titan_launch import CONFIGS, launch

DEMO = CONFIGS / "cpu_2x2_flexdemo.toml"
HSDP = CONFIGS / "cpu_2x2_hsdp_adamw.toml"
TIMEOUT = 400


def _steps(steps, every):
    return ("--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", str(every),
            "--checkpoint.no-last-save-model-only", "--flexdemo.replica_check_interval", str(every))


def _topology(replicas, shards):
    return ("--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shards))


def _resume_from(run, step, dump):
    shutil.copytree(run.dump / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, assets):
    run = launch(DEMO, tmp_path_factory.mktemp("a"), *_steps(4, 4), *_topology(2, 2), assets=assets, timeout=TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    return run


def _said(run, rank, text):
    return any(text in line for line in run.rank_lines(rank))


def test_resume_on_more_replicas_then_fewer(two_by_two, tmp_path, assets):
    # 2 x 2 -> 4 x 1: replicas 2 and 3 start from copies of 0's and 1's momentum; FSDP's shards merge.
    dump = _resume_from(two_by_two, 4, tmp_path / "b")
    four = launch(DEMO, dump, *_steps(6, 6), *_topology(4, 1), assets=assets, timeout=TIMEOUT)
    assert four.returncode == 0, four.output[-6000:]
    assert min(four.losses(0)) == 5  # it resumed
    assert _said(four, 3, "(written by 2 replicas x 2 shards) on 4 x 1: replica 3 takes saved replica 1's own state")
    d = four.digests()
    assert len({d[(r, 6)] for r in range(4)}) == 1  # 4 replicas of 1 shard: all identical
    # 4 x 1 -> 2 x 2: the state of replicas 2 and 3 is dropped, shards split again.
    dump = _resume_from(four, 6, tmp_path / "c")
    two = launch(DEMO, dump, *_steps(8, 8), *_topology(2, 2), assets=assets, timeout=TIMEOUT)
    assert two.returncode == 0, two.output[-6000:]
    assert min(two.losses(0)) == 7
    assert _said(two, 2, "(written by 4 replicas x 1 shards) on 2 x 2: replica 1 takes saved replica 1's own state")
    d = two.digests()
    assert d[(0, 8)] == d[(2, 8)] and d[(1, 8)] == d[(3, 8)]


def test_switching_optimizers_through_a_model_only_checkpoint(tmp_path, assets):
    fresh_loss = None
    runs = [(HSDP, "off"), (DEMO, "demo"), (HSDP, "off")]  # AdamW -> FlexDeMo -> AdamW
    previous = None
    for i, (config, mode) in enumerate(runs):
        args = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "4"]  # last save: model only
        if previous is not None:
            args += ["--checkpoint.initial_load_path", str(previous.dump / "checkpoint" / "step-4")]
        run = launch(config, tmp_path / f"run{i}", *args, assets=assets, timeout=TIMEOUT)
        assert run.returncode == 0, run.output[-6000:]
        losses = run.losses(0)
        if previous is None:
            fresh_loss = losses[1]
        else:  # it started from the previous run's weights, not from scratch
            assert losses[1] < fresh_loss - 0.3, (mode, losses[1], fresh_loss)
        previous = run


@pytest.mark.parametrize("overrides,message", [
    (("--flexdemo.topk", "16"), "was written with [mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=False], "
                                "this run asks for [mode=demo,topk=16,"),
    (("--flexdemo.mode", "off"), "this run asks for [mode=off]"),
])
def test_a_checkpoint_of_other_settings_is_refused(two_by_two, tmp_path, assets, overrides, message):
    dump = _resume_from(two_by_two, 4, tmp_path / "d")
    run = launch(DEMO, dump, *_steps(6, 6), *overrides, assets=assets, timeout=120)
    assert run.returncode != 0
    flat = " ".join(run.output.split())
    assert message in flat and "--checkpoint.initial_load_model_only" in flat, run.output[-3000:]
    assert "step:" not in run.output  # refused before training
