"""End to end on CPU: torchtitan 0.2.2's stock trainer through the flexdemo plugin,
4 gloo processes = 2 replicas x 2 FSDP shards, launched by scripts/launch.sh.

Slow (each launch pays ~1 min of imports on 2 cores); the module shares one 20-step
demo run between the tests that only read its logs/checkpoints.

The losses are checked for what holds on every machine (finite, falling; the replicas'
digests equal); a curve recorded on one CPU is not, since another ISA's kernels round differently.
"""

import os
import shutil
import signal
import sys

import pytest
import torch

from titan_launch import (CONFIGS, REPO, check_loss_falls, cpu_model_args, expected_payload_bytes, launch, load_dcp,
                          tensorboard_scalars, worker_pid)
from torchtitan_version import needs_torchtitan_0_2

STEPS, CKPT_STEP = 20, 10
DEMO = CONFIGS / "cpu_2x2_flexdemo.toml"
HSDP = CONFIGS / "cpu_2x2_hsdp_adamw.toml"
RUN_TIMEOUT = 400


def _demo_overrides():
    return (
        "--optimizer.weight_decay", "0.05",  # DeMo does not read it: the run must say so
        "--training.steps", str(STEPS),
        "--checkpoint.enable",
        "--checkpoint.interval", str(CKPT_STEP),
        "--flexdemo.replica_check_interval", str(CKPT_STEP),
        # Held-out loss every 5 steps, same batches each time: a resumed run must score what
        # the uninterrupted one did.
        "--validation.enable", "--validation.freq", "5", "--validation.steps", "2",
        "--validation.dataset", "flexdemo_stdlib_validation", "--validation.local_batch_size", "2",
        "--validation.seq_len", "128",
    )


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, assets):
    run = launch(DEMO, tmp_path_factory.mktemp("demo"), *_demo_overrides(),
                 assets=assets, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    return run


def test_demo_loss_curve(demo_run):
    losses = demo_run.losses(rank=0)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    # Recorded runs fell by ~1.3 (train) and ~1.6 (held-out) over these 20 steps; lr 0 falls by 0.
    check_loss_falls("demo train", losses, 0.5)
    check_loss_falls("demo held-out", demo_run.validation_losses(0), 0.5)


def test_demo_replicas_bit_identical(demo_run):
    # Verified in-run by flexdemo.replica_check at steps 10 and 20 (a mismatch stops the
    # run), and independently here from the per-rank digests of the local shards.
    d = demo_run.digests()
    for step in (CKPT_STEP, STEPS):
        assert {r for r, s in d if s == step} == {0, 1, 2, 3}, d
        # rank = replica * 2 + shard: ranks 0/2 hold shard 0, ranks 1/3 shard 1.
        assert d[(0, step)] == d[(2, step)]
        assert d[(1, step)] == d[(3, step)]
        assert d[(0, step)] != d[(1, step)]
    assert d[(0, CKPT_STEP)] != d[(0, STEPS)]  # and the params did change


@needs_torchtitan_0_2
def test_demo_logged_bytes_match_formula(demo_run):
    replicas = 2
    for rank in range(4):
        xchg = demo_run.exchange(rank)
        assert sorted(xchg) == list(range(1, STEPS + 1)), xchg
        expected = expected_payload_bytes(shard=rank % 2)
        for step, (sent, recv, sent_total, recv_total) in xchg.items():
            assert sent == expected, (rank, step, sent, expected)
            assert recv == (replicas - 1) * expected
            assert sent_total == step * expected
            assert recv_total == step * (replicas - 1) * expected
    # Sanity: ~52 B per 4096 fp32 values (12-bit indices + sign bits) vs 16 KiB dense.
    n_local = sum(p.numel() for p in _meta_params()) / 2
    assert expected_payload_bytes(0) < 0.01 * 4 * n_local


def _meta_params():
    from torchtitan.models.llama3 import Transformer

    with torch.device("meta"):
        return list(Transformer(cpu_model_args()).parameters())


def _assert_same_checkpoint(dump_a, dump_b, step):
    a = load_dcp(dump_a / "checkpoint" / f"step-{step}")
    b = load_dcp(dump_b / "checkpoint" / f"step-{step}")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k


def test_demo_resume_is_bit_identical(demo_run, tmp_path, assets):
    # Restart from the step-10 checkpoint of the 20-step run and train to 20 again.
    src = demo_run.dump / "checkpoint" / f"step-{CKPT_STEP}"
    assert src.is_dir(), list((demo_run.dump / "checkpoint").iterdir())
    dump = tmp_path / "resumed"
    shutil.copytree(src, dump / "checkpoint" / f"step-{CKPT_STEP}")
    run = launch(DEMO, dump, *_demo_overrides(), assets=assets, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    ref, got = demo_run.losses(0), run.losses(0)
    assert min(got) == CKPT_STEP + 1, sorted(got)  # it really resumed
    # Same losses for the overlapping steps ...
    for step in range(CKPT_STEP + 1, STEPS + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])
    # ... the same held-out losses (the resumed run validates from the split's start too) ...
    ref_val, got_val = demo_run.validation_losses(0), run.validation_losses(0)
    assert sorted(ref_val) == [1, 5, 10, 15, 20] and sorted(got_val) == [15, 20], (ref_val, got_val)
    assert all(got_val[s] == ref_val[s] for s in got_val), (ref_val, got_val)
    # ... the checkpointed byte counters continued ...
    assert run.exchange(0)[STEPS] == demo_run.exchange(0)[STEPS]
    # ... and bit-identical final parameters.
    _assert_same_checkpoint(demo_run.dump, dump, STEPS)


def test_killed_rank_restarts_from_checkpoint_and_ends_identical(demo_run, tmp_path, assets):
    # SIGKILL local rank 2 (replica 1, shard 0) after it passed the step-10 checkpoint; torchrun
    # (MAX_RESTARTS=1) restarts every rank, which resume from step 10 and end at step 20 with
    # the uninterrupted run's parameters.
    dump = tmp_path / "killed"
    killed = []

    def kill_rank_2(run):
        if killed:
            return
        steps = list(run.losses(rank=2))
        if steps and max(steps) >= CKPT_STEP + 2 and (pid := worker_pid(dump, 2)) is not None:
            os.kill(pid, signal.SIGKILL)
            killed.append(max(steps))

    run = launch(DEMO, dump, *_demo_overrides(), assets=assets, timeout=2 * RUN_TIMEOUT,
                 env={"MAX_RESTARTS": "1"}, while_running=kill_rank_2)
    assert killed, "rank 2 never reached the kill point"
    assert run.returncode == 0, run.output[-6000:]
    attempts = {f.parts[-3] for f in run.log_dir.glob("*/attempt_*/2/stdout.log")}
    assert attempts == {"attempt_0", "attempt_1"}, attempts
    assert killed[0] < STEPS  # it died mid-run, not at the end
    d, ref = run.digests(), demo_run.digests()
    for rank in range(4):
        assert d[(rank, STEPS)] == ref[(rank, STEPS)], (rank, d, ref)
    _assert_same_checkpoint(demo_run.dump, dump, STEPS)


def test_benchmark_log_parser_reads_the_run(demo_run, tmp_path):
    # benchmarks/titan_logs.py (behind the summary, shaped-link and plot scripts) reads rank 0's
    # console as the tests' own regexes read rank 0's log file.
    sys.path.insert(0, str(REPO / "benchmarks"))
    from titan_logs import parse, seconds_per_step

    console = tmp_path / "console.log"
    console.write_text(demo_run.output)
    run = parse(console)
    assert run.loss == demo_run.losses(0) and len(run.loss) == STEPS
    assert run.tokens_per_step == 4 * 2 * 128  # 4 ranks x local batch 2 x seq_len 128
    xchg = demo_run.exchange(0)
    assert len(run.exchange) >= 2 and not run.bytes_modelled
    for step, x in run.exchange.items():
        assert (x.sent, x.received, x.received_total) == (xchg[step][0], xchg[step][1], xchg[step][3])
    assert sorted(run.step_time) == sorted(run.loss) and run.step_time[1] == 0
    assert 0 < seconds_per_step(run) < RUN_TIMEOUT


def test_hsdp_adamw_baseline_loss_curve(tmp_path, assets):
    run = launch(HSDP, tmp_path / "hsdp", "--training.steps", "12",
                 "--flexdemo.replica_check_interval", "12", assets=assets, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    losses = run.losses(0)
    assert sorted(losses) == list(range(1, 13))
    check_loss_falls("hsdp adamw train", losses, 0.2)  # recorded: ~0.4 over 12 steps
    d = run.digests()
    assert d[(0, 12)] == d[(2, 12)] and d[(1, 12)] == d[(3, 12)]
    log = " ".join(run.rank_lines(0))
    assert "modelled ring all-reduce of HSDP/DDP" in log
    # Modelled bytes never under the names of measured ones: console and TensorBoard.
    assert "sent_bytes_modelled:" in log and run.exchange(0) == {}
    tags, _ = tensorboard_scalars(run)
    assert "replica_exchange/bytes_sent_modelled" in tags and "replica_exchange/bytes_sent" not in tags


def test_launcher_says_when_it_supplies_the_tokenizer(demo_run, assets):
    # cpu_2x2_flexdemo.toml names no tokenizer: flexdemo's is used, and the launcher says so once.
    said = [line for line in demo_run.output.splitlines() if "holds no tokenizer" in line]
    assert said == [f"flexdemo: [model] hf_assets_path '' holds no tokenizer; using flexdemo's embedded "
                    f"tokenizer from {assets}"], said


def test_demo_warns_about_optimizer_keys_it_does_not_use(demo_run):
    warnings = [line for line in demo_run.rank_lines(0) if "does not use" in line]
    assert len(warnings) == 1 and "optimizer.weight_decay" in warnings[0], warnings


@needs_torchtitan_0_2
def test_demo_tensorboard_has_exchange_metrics(demo_run):
    tags, acc = tensorboard_scalars(demo_run)
    for tag in ("replica_exchange/bytes_sent", "replica_exchange/bytes_received",
                "replica_exchange/bytes_sent_total", "replica_exchange/exchange(s)"):
        assert tag in tags, sorted(tags)
    assert not any(t.endswith("_modelled") for t in tags)  # these bytes are measured
    sent = [e.value for e in acc.Scalars("replica_exchange/bytes_sent")]
    assert len(sent) == STEPS and sent[0] == expected_payload_bytes(shard=0)


def test_qwen3_family_demo_loss_curve(tmp_path, assets):
    # The second model family shipped in torchtitan 0.2.2, through the same spec wrapper;
    # 2 processes = 2 replicas x 1 shard (the no-FSDP path) to keep the suite short.
    run = launch(DEMO, tmp_path / "qwen3", "--model.name", "flexdemo_qwen3",
                 "--model.flavor", "debugmodel_untied", "--training.steps", "3",
                 "--parallelism.data_parallel_shard_degree", "1",
                 "--flexdemo.replica_check_interval", "3", assets=assets, timeout=RUN_TIMEOUT, nproc=2)
    assert run.returncode == 0, run.output[-6000:]
    assert sorted(run.losses(0)) == [1, 2, 3]
    # The logged loss is the global mean, the same on both replicas, and it falls, also with one
    # shard per replica.
    assert run.losses(0) == run.losses(1), (run.losses(0), run.losses(1))
    check_loss_falls("qwen3 demo train", run.losses(0), 0.3)  # recorded: ~0.9 over 3 steps
    d = run.digests(ranks=range(2))
    assert d[(0, 3)] == d[(1, 3)]
    assert run.exchange(0)[3][0] > 0


@pytest.mark.parametrize("lookahead", [False, True])
def test_overlap_resume_is_bit_identical(tmp_path, assets, lookahead):
    # overlap: each step's exchange is applied at the next step; a checkpoint holds the
    # exchange in flight (per rank), so a resumed run applies it exactly where the
    # uninterrupted one does. With the look-ahead the checkpoint's parameters are one replica's
    # live ones: each replica rebuilds its own from the saved base; the replica checks (every
    # 4 steps) compare the bases.
    steps, ckpt = 8, 4
    args = ("--flexdemo.overlap", "--training.steps", str(steps), "--checkpoint.enable",
            "--checkpoint.interval", str(ckpt), "--flexdemo.replica_check_interval", str(ckpt),
            *(("--flexdemo.overlap_lookahead",) if lookahead else ()))
    full = launch(DEMO, tmp_path / "full", *args, assets=assets, timeout=RUN_TIMEOUT)
    assert full.returncode == 0, full.output[-6000:]
    saved = load_dcp(full.dump / "checkpoint" / f"step-{ckpt}")["optimizer"]
    pending = {k: v for k, v in saved.items() if k.startswith("flexdemo.pending_exchange.")}
    names = {"pending", "bytes", "lrs", *(("lookahead",) if lookahead else ())}
    assert {k.rsplit(".", 1)[1] for k in pending} == names and len(pending) == len(names) * 4
    assert all(int(v.item()) == 1 for k, v in pending.items() if k.endswith((".pending", ".lookahead")))
    assert any("lookahead_base" in k for k in saved) == lookahead
    dump = tmp_path / "resumed"
    shutil.copytree(full.dump / "checkpoint" / f"step-{ckpt}", dump / "checkpoint" / f"step-{ckpt}")
    resumed = launch(DEMO, dump, *args, assets=assets, timeout=RUN_TIMEOUT)
    assert resumed.returncode == 0, resumed.output[-6000:]
    for step in range(ckpt + 1, steps + 1):
        assert resumed.losses(0)[step] == full.losses(0)[step], step
    assert resumed.digests()[(0, steps)] == full.digests()[(0, steps)]


def test_validating_every_step_leaves_training_bit_identical(demo_run, tmp_path, assets):
    # Runs that validate at other frequencies pair seed for seed (benchmarks/paired_seeds.py, the
    # GPU batches at --validation.freq 399 and 798): scoring the held-out split must not move
    # training. Validating at every step instead of every 5th: the same losses, the same replica
    # digests, and validation losses where the shared run has them equal to its.
    every = launch(DEMO, tmp_path / "every", *_demo_overrides(), "--validation.freq", "1",
                   assets=assets, timeout=RUN_TIMEOUT)
    assert every.returncode == 0, every.output[-3000:]
    assert sorted(every.validation_losses(0)) == list(range(1, STEPS + 1))
    assert every.losses(0) == demo_run.losses(0) and sorted(every.losses(0)) == list(range(1, STEPS + 1))
    assert every.digests() == demo_run.digests() and (0, STEPS) in every.digests()
    ref = demo_run.validation_losses(0)
    assert ref and all(every.validation_losses(0)[step] == loss for step, loss in ref.items())


@needs_torchtitan_0_2
def test_the_shared_gpu_harness_and_elias_fano_indices_train_the_same_run(demo_run, tmp_path, assets):
    # Two changes that must leave training bit for bit as it was, in one launch against the shared
    # run (scripts/launch.sh, fixed-width indices): the ranks started by benchmarks/shared_gpu.py (a
    # job's replicas on one GPU over gloo, for results where one GPU is lent; its own process group
    # set up first, gloo on CPU as launch.sh's), and index_coding = "elias_fano". The same losses and
    # replica digests; fewer bytes in the exchange metrics.
    fixed = demo_run
    ef = launch(DEMO, tmp_path / "ef", *_demo_overrides(), "--flexdemo.index_coding", "elias_fano", assets=assets,
                timeout=RUN_TIMEOUT, launcher=[sys.executable, str(REPO / "benchmarks" / "shared_gpu.py")])
    assert ef.returncode == 0, ef.output[-3000:]
    assert "already initialized" in ef.output  # torchtitan kept the harness's process group
    assert "elias_fano indices" in ef.output
    assert ef.losses(0) == fixed.losses(0) and sorted(ef.losses(0)) == list(range(1, STEPS + 1))
    assert ef.digests() == fixed.digests() and (0, STEPS) in ef.digests()
    for rank in range(4):
        for step, (sent, received, _, _) in ef.exchange(rank).items():
            assert 0 < sent < fixed.exchange(rank)[step][0] and received < fixed.exchange(rank)[step][1]
