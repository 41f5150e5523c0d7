"""flexdemo on torchtitan 0.3.0 (flexdemo.titan.v0_3): the TOML reader maps and refuses, the
config_registry works through torchtitan's ConfigManager, every mode trains 2 x 2 on CPU through
flexdemo's launcher with the replicas identical, and resume equals the uninterrupted run.

Skipped unless torchtitan 0.3.x is installed (the suite's main environment has 0.2.2), e.g.:
    PYTHONPATH=. /work/venv030/bin/python -m pytest tests/test_torchtitan_0_3.py
"""

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

TORCHTITAN = importlib.metadata.version("torchtitan")
pytestmark = pytest.mark.skipif(not TORCHTITAN.startswith("0.3."),
                                reason=f"needs torchtitan 0.3.x (installed: {TORCHTITAN})")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
MODES = {"demo": "cpu_2x2_flexdemo", "off": "cpu_2x2_hsdp_adamw", "diloco": "cpu_2x2_diloco",
         "demo_diloco": "cpu_2x2_demo_diloco"}
STEP_RE = re.compile(r"step:\s*(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s*([0-9.]+)")
CHECK_RE = re.compile(r"replica check at step (\d+): 2 replicas identical")


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


def test_module_config_through_torchtitans_config_manager():
    from torchtitan.config import ConfigManager

    c = ConfigManager().parse_args(["--module", "flexdemo.titan.v0_3", "--config", "cpu_2x2_demo_diloco",
                                    "--training.steps", "9", "--flexdemo.outer-topk", "16"])
    assert type(c).__qualname__ == "FlexTrainer.Config"
    assert (c.flexdemo.mode, c.flexdemo.outer_topk, c.training.steps) == ("demo_diloco", 16, 9)


# -- end to end (4 gloo processes) -------------------------------------------------------------

def launch(config, dump, *overrides, timeout=420):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flexdemo.titan.launch", "--local-ranks-filter", "0", "--",
           str(CONFIGS / f"{config}.toml"), "--job.dump_folder", str(dump), *overrides]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
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


# -- elastic replicas on torchft (flexdemo.titan.elastic, as on 0.2.2: tests/test_titan_elastic.py) --------

@pytest.mark.timeout(200)
def test_a_joining_replica_with_other_settings_is_refused_and_says_which(tmp_path):
    pytest.importorskip("torchft")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from ports import free_port

    port = free_port()
    lighthouse = subprocess.Popen(["bash", str(REPO / "scripts" / "lighthouse.sh"), str(port), "2"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    procs = []
    try:
        for replica, extra in ((0, []), (1, ["--flexdemo.topk", "16"])):
            cmd = [sys.executable, "-m", "flexdemo.titan.launch", "--", str(CONFIGS / "cpu_elastic_demo.toml"),
                   "--fault_tolerance.replica_id", str(replica), "--checkpoint.no_enable",
                   "--job.dump_folder", str(tmp_path / f"r{replica}"), *extra]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env={**env, "MASTER_PORT": str(free_port())},
                                          stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"r{replica}.err", "w"),
                                          start_new_session=True))
        # At step 0 one of the two heals from the other (torchft's init_sync) and compares.
        end = time.time() + 150
        while time.time() < end and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        refused = [r for r, p in enumerate(procs) if p.poll() is not None]
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert len(refused) == 1, "neither replica was refused in time"
    err = (tmp_path / f"r{refused[0]}.err").read_text()
    lines = [x for x in err.splitlines() if "refused at join" in x]
    assert procs[refused[0]].returncode != 0 and len(lines) == 1, err[-3000:]
    theirs, ours = ("32", "16") if refused[0] == 1 else ("16", "32")
    assert f"elastic replica {refused[0]} refused at join: its flexdemo.topk is {ours}, the quorum's is {theirs}" \
        in lines[0]


@pytest.mark.timeout(1500)
def test_elastic_demo_survives_a_killed_replica_and_heals_it_bitwise(tmp_path):
    # scripts/elastic_demo.sh on this Python (its replicas through scripts/launch.sh): three CPU replicas,
    # replica 2 killed and restarted from its checkpoint folder, in the per-step mode and in demo_diloco.
    pytest.importorskip("torchft")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    r = subprocess.run(["bash", str(REPO / "scripts" / "elastic_demo.sh"), "--out", str(tmp_path), "--steps", "100",
                        "--restart-at", "17", "--timeout", "400", "--no-baseline"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1450)
    lines = r.stdout.strip().splitlines()[-2:]
    for mode, line in zip(("demo", "demo_diloco"), lines):
        m = re.fullmatch(rf"elastic {mode}: survivors took (\d+) steps during the outage; rejoined replica bitwise "
                         r"equal: (yes|no); final loss ([\d.]+) \(uninterrupted not run\)", line)
        assert m, (line, r.stdout[-2000:], r.stderr[-2000:])
        assert m.group(2) == "yes" and int(m.group(1)) >= 5, line
        # the restarted replica loaded its own checkpoint, then took the live peers' later state
        m = re.search(rf"elastic {mode}: replica 2 restarted, loaded its checkpoint of step (\d+), healed from a "
                      r"live peer at step (\d+)", r.stderr)
        assert m and int(m.group(2)) > int(m.group(1)) >= 10, r.stderr[-2000:]
    assert r.returncode == 0 and len(lines) == 2, r.stdout[-2000:]
