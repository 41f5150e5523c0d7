"""flexdemo on torchtitan 0.3.0 (flexdemo.titan.v0_3): the TOML reader maps and refuses, the
config_registry works through torchtitan's ConfigManager, every mode trains 2 x 2 on CPU through
flexdemo's launcher with the replicas identical, resume equals the uninterrupted run, a checkpoint
resumes on another layout (replicas, shards, data-parallel world size), and the pre-flight prints
the memory estimate per GPU.

Skipped unless torchtitan 0.3.x is installed (the suite's main environment has 0.2.2), e.g.:
    PYTHONPATH=. /work/venv030/bin/python -m pytest tests/test_torchtitan_0_3.py
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_version import TORCHTITAN, needs_torchtitan_0_3

pytestmark = needs_torchtitan_0_3

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
MODES = {"demo": "cpu_2x2_flexdemo", "off": "cpu_2x2_hsdp_adamw", "diloco": "cpu_2x2_diloco",
         "demo_diloco": "cpu_2x2_demo_diloco"}
STEP_RE = re.compile(r"step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([0-9.]+)")
CHECK_RE = re.compile(r"replica check at step (\d+): 2 replicas identical")
CHECKS_RE = re.compile(r"replica check at step (\d+): (\d+) replicas identical")


def read(name, *overrides):
    from flexdemo.titan.v0_3.toml_config import read

    return read(str(CONFIGS / f"{name}.toml"), list(overrides))


# -- the TOML reader --------------------------------------------------------------------------

def test_reader_maps_renamed_keys_and_overrides():
    from flexdemo.titan.v0_3.data import FlexDataLoader
    from flexdemo.titan.v0_3.trainer import FlexTrainer

    c = read("cpu_2x2_flexdemo", "--job.dump_folder", "/tmp/x", "--training.steps", "7", "--optimizer.lr", "1e-3",
             "--flexdemo.topk", "16", "--checkpoint.enable", "true", "--checkpoint.interval", "3",
             "--parallelism.data_parallel_shard_degree", "2", "--metrics.enable_tensorboard", "false")
    assert isinstance(c, FlexTrainer.Config)
    assert c.dump_folder == "/tmp/x" and c.training.steps == 7 and c.training.seq_len == 128
    assert c.optimizer.param_groups[0].optimizer_kwargs["lr"] == 1e-3
    assert c.flexdemo.mode == "demo" and c.flexdemo.topk == 16 and c.flexdemo.init_sync == "broadcast"
    assert c.checkpoint.enable is True and c.checkpoint.interval == 3 and c.metrics.enable_tensorboard is False
    assert isinstance(c.dataloader, FlexDataLoader.Config) and c.dataloader.dataset == "flexdemo_stdlib"
    assert c.dataloader.seed == 1234 and c.debug.seed == 1234  # 0.2.2 seeds flexdemo's data with [debug] seed
    assert c.model_spec.flavor == "debugmodel_2layer" and len(c.model_spec.model.layers) == 2
    assert c.parallelism.spmd_backend == "partial_dtensor" and c.activation_checkpoint is None
    assert os.path.isfile(os.path.join(c.hf_assets_path, "tokenizer.json"))  # "" -> flexdemo's tokenizer
    adam = read("cpu_2x2_diloco", "--checkpoint.no_enable", "--flexdemo.outer_nesterov", "false")
    kwargs = adam.optimizer.param_groups[0].optimizer_kwargs
    assert adam.optimizer.param_groups[0].optimizer_name == "AdamW" and adam.optimizer.implementation == "foreach"
    assert kwargs == {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert adam.checkpoint.enable is False and adam.flexdemo.outer_nesterov is False


@pytest.mark.parametrize("name", sorted(MODES.values()))
def test_every_cpu_2x2_config_reads(name):
    assert read(name).flexdemo.mode in MODES


@pytest.mark.parametrize("toml, overrides, says", [
    ("[training]\nsteps = 3\nfoo = 1\n", [], "[training] foo is not supported on torchtitan 0.3.0"),
    ("[nosuch]\nx = 1\n", [], "[nosuch] x is not supported"),
    ("[training]\nsteps = \"three\"\n", [], "[training] steps = 'three': expected a int"),
    ("[training]\nsteps = 3\n", ["--training.bar", "1"], "[training] bar is not supported"),
    ("[training]\nsteps = 3\n", ["--checkpoint.enable", "maybe"], "expected true or false"),
    ("[model]\nflavor = \"nosuch\"\n", [], "model.flavor 'nosuch'"),
    ("[validation]\nenable = true\nseq_len = 64\n[parallelism]\npipeline_parallel_degree = 2\n", [],
     "with pipeline parallelism torchtitan 0.3.0 validates with the training's"),
])
def test_reader_refuses_with_one_line(tmp_path, toml, overrides, says):
    from flexdemo.section import FlexDemoConfigError
    from flexdemo.titan.v0_3.toml_config import read as read_toml

    path = tmp_path / "c.toml"
    path.write_text(toml)
    with pytest.raises(FlexDemoConfigError) as e:
        read_toml(str(path), overrides)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, says", [
    ([], None),
    (["--fault_tolerance.semi_sync_method", "diloco"], "torchtitan's own DiLoCo"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "data_parallel_replicate_degree must be 1"),
    (["--fault_tolerance.replica_id", "3"], "0 <= replica_id < group_size"),
])
def test_elastic_config_reads_into_torchft_config_and_is_checked(monkeypatch, overrides, says):
    from flexdemo.section import FlexDemoConfigError
    from flexdemo.titan.v0_3.settings import validate

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "x")
    c = read("cpu_elastic_demo", "--fault_tolerance.replica_id", "2", *overrides)
    if says is None:
        ft = c.fault_tolerance
        assert type(ft).__qualname__ == "TorchFTManager.Config"
        assert (ft.enable, ft.replica_id, ft.group_size, ft.min_replica_size) == (True, 2, 3, 2)
        validate(c, 1)
        from torchtitan.config import ConfigManager  # the same through torchtitan's --module/--config

        c = ConfigManager().parse_args(["--module", "flexdemo.titan.v0_3", "--config", "cpu_elastic_demo",
                                        "--fault_tolerance.replica_id", "1"])
        assert (c.fault_tolerance.enable, c.fault_tolerance.replica_id) == (True, 1)
        return
    with pytest.raises(FlexDemoConfigError, match=re.escape(says)):
        validate(c, None)


def test_a_replica_is_refused_at_join_naming_the_setting_it_does_not_share():
    from flexdemo.elastic.group import ElasticJoinError
    from flexdemo.titan.elastic import refuse_if_different
    from flexdemo.titan.v0_3.settings import run_settings

    quorum = run_settings(read("cpu_elastic_demo")).items()
    names = [k for k, _ in quorum]
    assert "flexdemo.topk" in names and "fault_tolerance.group_size" in names  # 0.2.2's names
    assert not any("replica_id" in k or "dump_folder" in k for k in names)  # each replica's own
    refuse_if_different(run_settings(read("cpu_elastic_demo", "--fault_tolerance.replica_id", "2")).items(), quorum, 2)
    for flag, value, theirs in (("--flexdemo.topk", "16", "32"), ("--fault_tolerance.group_size", "4", "3")):
        with pytest.raises(ElasticJoinError, match=rf"replica 2 refused at join: its {flag[2:]} is {value}, the "
                                                   rf"quorum's is {theirs}"):
            refuse_if_different(run_settings(read("cpu_elastic_demo", flag, value)).items(), quorum, 2)


def test_the_planner_refuses_with_one_line_naming_the_version():
    # The planner reads configs with 0.2.2's ConfigManager: on 0.3.x it says so, not an ImportError.
    cmd = [sys.executable, "-m", "flexdemo.plan", str(CONFIGS / "multinode_llama3_1b_flexdemo.toml"), "--nodes", "2",
           "--link-gbit", "1", "--gpu", "H200"]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stdout == "", p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [
        "flexdemo.plan: the planner reads configs with torchtitan 0.2.2; this Python has torchtitan "
        f"{TORCHTITAN}: run it from a 0.2.2 environment (the TOML files are the same)"]


def test_module_config_through_torchtitans_config_manager():
    from torchtitan.config import ConfigManager

    c = ConfigManager().parse_args(["--module", "flexdemo.titan.v0_3", "--config", "cpu_2x2_demo_diloco",
                                    "--training.steps", "9", "--flexdemo.outer-topk", "16"])
    assert type(c).__qualname__ == "FlexTrainer.Config"
    assert (c.flexdemo.mode, c.flexdemo.outer_topk, c.training.steps) == ("demo_diloco", 16, 9)


# -- end to end (4 gloo processes) -------------------------------------------------------------

def launch(config, dump, *overrides, timeout=420, expect_rc=0):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flexdemo.titan.launch", "--local-ranks-filter", "0", "--",
           str(CONFIGS / f"{config}.toml"), "--job.dump_folder", str(dump), *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == expect_rc, out[-4000:]
    losses = {int(s): float(v) for s, v in STEP_RE.findall(out)}
    return losses, [int(s) for s in CHECK_RE.findall(out)], out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_each_mode_trains_2x2_with_replicas_identical(tmp_path, mode):
    losses, checked, _ = launch(MODES[mode], tmp_path, "--training.steps", "10")
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1]
    assert 10 in checked  # replica_check_interval = 10 in every CPU 2x2 config


@pytest.mark.parametrize("mode", ["demo", "demo_diloco"])
def test_resume_equals_uninterrupted(tmp_path, mode):
    ck = ["--training.steps", "7", "--checkpoint.enable", "true", "--checkpoint.interval", "3"]
    whole, _, _ = launch(MODES[mode], tmp_path, *ck)
    for step in (6, 7):  # resume from step 3 (mid-cycle in demo_diloco: an outer step at 5)
        subprocess.run(["rm", "-rf", str(tmp_path / "checkpoint" / f"step-{step}")], check=True)
    resumed, _, out = launch(MODES[mode], tmp_path, *ck, "--checkpoint.load_step", "3")
    assert sorted(resumed) == [4, 5, 6, 7], out[-3000:]
    assert all(resumed[s] == whole[s] for s in resumed), (whole, resumed)


# -- resume on another layout (as 0.2.2: tests/test_titan_checkpoints.py) ----------------------------

LOCAL_BATCH, SEQ_LEN, SEED = 2, 128, 1234  # the CPU 2x2 configs' data


def _layout(replicas, shards):
    return ("--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shards))


def _data_states(step_dir):
    """Each data-parallel rank's dataset state in a checkpoint, in rank order."""
    import pickle

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = step_dir.parent / f"{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    saved = torch.load(out, weights_only=False)["dataloader"]
    return [pickle.loads(saved[f"dp_rank_{r}"])["dataset_state"] for r in range(saved["world_size"])]


def _replayed(states, world, steps, assets):
    """The dataset states of ``world`` ranks after ``steps`` batches read from ``states`` resharded
    onto them (flexdemo.data.resharding's rule), outside torchtitan."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from flexdemo.data.assets import load_corpus
    from flexdemo.data.dataset import StdlibTextDataset
    from flexdemo.data.resharding import reshard_dataset_states

    documents, tokenizer, out = load_corpus(assets)["train"], HuggingFaceTokenizer(tokenizer_path=assets), []
    for rank in range(world):
        ds = StdlibTextDataset(documents, tokenizer, seq_len=SEQ_LEN, dp_rank=rank, dp_world_size=world,
                               infinite=True, seed=SEED)
        ds.load_state_dict(reshard_dataset_states(states, len(documents), rank, world, SEED))
        samples = iter(ds)
        for _ in range(steps * LOCAL_BATCH):
            next(samples)
        out.append(ds.state_dict())
    return out


@pytest.mark.parametrize("mode", ["demo", "demo_diloco"])
def test_resume_on_another_layout(tmp_path, mode):
    # One dump folder: 2 x 2 to step 3 (mid-cycle in demo_diloco: outer step every 5), 4 x 1 to step 5
    # (the same data-parallel world: per-replica state r <- r mod 2, DTensors resharded), 2 x 1 to
    # step 10 (data-parallel world 4 -> 2: flexdemo's corpus position resharded); replicas identical
    # at 5 and 10; then a dataset torchtitan cannot reshard refused in the pre-flight, one line.
    # demo_diloco: the first hop only (its replicas' own local parameters, r <- r mod 2, mid-cycle).
    ck = ("--checkpoint.enable", "true", "--checkpoint.last_save_model_only", "false",
          "--flexdemo.replica_check_interval", "5")
    first, _, _ = launch(MODES[mode], tmp_path, "--training.steps", "3", *ck, "--checkpoint.interval", "3",
                         *_layout(2, 2))
    assert sorted(first) == [1, 2, 3]
    hops = ((4, 1, 5, "written by 2 replicas x 2 shards) on 4 x 1: replica 0 takes saved replica 0's own state"),
            (2, 1, 10, "written by 4 replicas x 1 shards) on 2 x 1: replica 0 takes saved replica 0's own state"))
    if mode == "demo_diloco":  # the file's time on 2 cores: the per-replica local parameters' hop only
        hops = hops[:1]
    step = 3
    for replicas, shards, last, said in hops:
        losses, _, out = launch(MODES[mode], tmp_path, "--training.steps", str(last), *ck, "--checkpoint.interval",
                                str(last - step), *_layout(replicas, shards))
        assert sorted(losses) == list(range(step + 1, last + 1)), out[-3000:]
        assert said in out, out[-3000:]
        assert (str(last), str(replicas)) in CHECKS_RE.findall(out), out[-3000:]
        step = last
    if mode == "demo_diloco":
        return
    assert "position saved by 4 data-parallel ranks resharded onto 2" in out, out[-3000:]
    # the 2 ranks' position at step 10 = the 4 ranks' at step 5 resharded by the rule, read on 5 steps
    from flexdemo.data.assets import ensure_assets

    ck_dir = tmp_path / "checkpoint"
    assert _data_states(ck_dir / "step-10") == _replayed(_data_states(ck_dir / "step-5"), 2, 5, ensure_assets())
    _, _, out = launch(MODES[mode], tmp_path, "--training.steps", "12", *ck, "--training.dataset", "c4_test",
                       *_layout(2, 2), expect_rc=2)
    lines = [x for x in out.splitlines() if x.startswith("flexdemo: ")]
    assert len(lines) == 1 and "holds the data position of 2 data-parallel ranks, this run has 4" in lines[0] \
        and "cannot reshard it" in lines[0], out[-3000:]
    assert not STEP_RE.search(out)


# -- the pre-flight's memory estimate (flexdemo.titan.memory, as on 0.2.2) -------------------------------

def test_validation_scores_the_same_windows_and_logs_what_it_read(tmp_path, assets):
    # torchtitan 0.3.0's Validator builds its loader at every validation: with lr 0 every validation
    # logs one loss, and the log names the training corpus's sha256 and the digest of the held-out
    # windows scored (windows 0..23 in order: 3 steps x batch 2 x 4 data ranks), as on 0.2.2.
    import hashlib

    import torch

    from flexdemo.data import load_corpus
    from flexdemo.data.tokenizer import FileTokenizer
    from flexdemo.data.heldout import HeldOutTokens

    _, _, out = launch("cpu_2x2_hsdp_adamw", tmp_path, "--training.steps", "4", "--optimizer.lr", "0",
                       "--lr_scheduler.warmup_steps", "0", "--validation.enable", "--validation.freq", "2",
                       "--validation.steps", "3", "--validation.dataset", "flexdemo_stdlib_validation",
                       "--validation.dataset_path", str(assets), "--validation.local_batch_size", "2",
                       "--validation.seq_len", "64")
    losses = dict(re.findall(r"validate step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([0-9.]+)", out))
    assert {2, 4} <= set(map(int, losses)) and len(set(losses.values())) == 1, losses
    windows = HeldOutTokens(load_corpus(assets)["validation"], FileTokenizer(str(assets)), 64).tokens[:24]
    digest = hashlib.sha256(windows.to(torch.int32).numpy().tobytes()).hexdigest()
    assert set(re.findall(r"heldout_digest=([0-9a-f]+)", out)) == {digest}
    corpus = hashlib.sha256((Path(assets) / "corpus.json").read_bytes()).hexdigest()[:16]
    assert re.findall(r"corpus_sha256=([0-9a-f]+)", out) == [corpus]


@pytest.mark.parametrize("overrides, says", [
    (["--validation.local_batch_size", "100003"],  # (a prime above any N / 4 of the stdlib's split)
     "windows do not split into batches of 4 data-parallel ranks x local_batch_size 100003"),
    (["--validation.steps", "100000"], "[validation] steps 100000 outside 1.."),
])
def test_preflight_refuses_a_heldout_layout_before_any_rank(monkeypatch, capsys, overrides, says):
    # 0.3.0 builds the validator's loader at the first validation; the launcher's check refuses first
    from flexdemo.titan.v0_3 import launch_plan

    monkeypatch.setenv("NPROC", "4")
    with pytest.raises(SystemExit) as e:
        launch_plan.nproc(str(CONFIGS / "cpu_2x2_flexdemo.toml"), ["--validation.enable", "--validation.dataset",
                          "flexdemo_stdlib_validation", "--validation.seq_len", "64", *overrides], 0)
    assert e.value.code == 2 and says in capsys.readouterr().err


MEMORY_LINE = re.compile(r"^flexdemo: memory per GPU \(estimate\): params=([0-9.]+)GiB .* total=([0-9.]+)GiB.*$", re.M)


def test_preflight_prints_the_memory_estimate(capsys):
    from flexdemo.titan.v0_3 import launch_plan, memory
    from flexdemo.titan.v0_3.toml_config import read as read_toml

    assert launch_plan.nproc(str(CONFIGS / "cpu_2x2_flexdemo.toml"), [], 0) == 4
    m = MEMORY_LINE.search(capsys.readouterr().err)
    assert m, "no memory line"
    assert "[llama3 debugmodel_2layer, mode demo, fsdp 2 x tp 1, batch 2 x seq 128" in m.group(0)
    # the parameter count of 0.3.0's model (fused wqkv, lm_head), each parameter once, sharded 2 ways
    import torch

    config = read_toml(str(CONFIGS / "cpu_2x2_flexdemo.toml"))
    with torch.device("meta"):
        model = config.model_spec.model.build()
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("qkv_linear.wqkv.weight") for n in names) and "lm_head.weight" in names
    shapes = memory.model_shapes(config)
    assert sum(p.numel() for p in model.parameters()) == sum(torch.Size(s).numel() for _, s in shapes.params)
    est = memory.estimate(config, 4)
    assert est.params == 4 * sum(-(-s[0] // 2) * (torch.Size(s).numel() // s[0]) for _, s in shapes.params)
    assert (shapes.q_dim, shapes.kv_dim, shapes.vocab) == (256, 256, 2048)  # debugmodel: 16 heads x 16


@pytest.mark.parametrize("check, exits", [("refuse", True), ("warn", False), ("off", False)])
def test_memory_check_refuses_a_config_that_cannot_fit(monkeypatch, capsys, check, exits):
    from flexdemo.titan import memory
    from flexdemo.titan.v0_3 import launch_plan

    monkeypatch.setattr(memory, "visible_device", lambda: (2 * memory.GIB, "tiny GPU"))
    argv = [str(CONFIGS / "cpu_2x2_flexdemo.toml"), ["--model.flavor", "1B", "--flexdemo.memory_check", check], 0]
    if exits:
        with pytest.raises(SystemExit) as e:
            launch_plan.nproc(*argv)
        assert e.value.code == 2
    else:
        assert launch_plan.nproc(*argv) == 4
    err = capsys.readouterr().err
    refused = [x for x in err.splitlines() if 'memory_check = "refuse": the estimated memory per GPU' in x]
    warned = [x for x in err.splitlines() if x.startswith("flexdemo: WARNING: the estimated memory per GPU")]
    assert (len(refused), len(warned), bool(MEMORY_LINE.search(err))) == \
        {"refuse": (1, 0, True), "warn": (0, 1, True), "off": (0, 0, False)}[check], err


# -- elastic replicas on torchft (flexdemo.titan.elastic, as on 0.2.2: tests/test_titan_elastic.py) --------

@pytest.mark.timeout(200)
def test_a_joining_replica_with_other_settings_is_refused_and_says_which(tmp_path):
    pytest.importorskip("torchft")
    from elastic_join import check_join_refused

    def command(replica, extra):
        return [sys.executable, "-m", "flexdemo.titan.launch", "--", str(CONFIGS / "cpu_elastic_demo.toml"),
                "--fault_tolerance.replica_id", str(replica), "--checkpoint.no_enable",
                "--job.dump_folder", str(tmp_path / f"r{replica}"), *extra]

    check_join_refused(tmp_path, command, {**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(1500)
def test_elastic_demo_survives_a_killed_replica_and_heals_it_bitwise(tmp_path):
    # scripts/elastic_demo.sh on this Python (its replicas through flexdemo's launcher), as on 0.2.2
    pytest.importorskip("torchft")
    from elastic_join import check_kill_and_heal

    check_kill_and_heal(tmp_path, {**os.environ, "PYTHONPATH": str(REPO)})
