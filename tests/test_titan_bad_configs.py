"""Bad configs fail fast: non-zero exit, one clear message, no hang (each run is bounded by a
timeout), before any training step. Every case goes through the launcher's own check
(flexdemo.titan.launch.plan, what scripts/launch.sh runs before torchrun starts a rank), all of
them in one process; two of them also through scripts/launch.sh end to end."""

import json
import os
import subprocess
import sys

import pytest

from titan_launch import CONFIGS, REPO, cache_holding, launch
from torchtitan_version import ON_0_3, needs_torchtitan_0_2

DEMO = CONFIGS / "cpu_2x2_flexdemo.toml"

CASES = {
    "replicate_not_dividing_world": (
        ["--parallelism.data_parallel_replicate_degree", "3"],
        "data_parallel_replicate_degree=3 (x tp*pp*cp=1) does not divide the world size 4",
    ),
    "tp_with_ddp_in_mode_off": (
        ["--flexdemo.mode", "off", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"],
        "needs data_parallel_shard_degree >= 2: with one shard torchtitan replicates through DDP",
    ),
    "pp_with_demo": (
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        "parallelism.pipeline_parallel_degree=2",
    ),
    # A Literal field: tyro itself names the choices.
    "unknown_value": (["--flexdemo.value_encoding", "int4"],
                      "invalid choice 'int4' for argument '--flexdemo.value-encoding'"),
    "cp_with_demo": (
        ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
        "parallelism.context_parallel_degree=2",
    ),
    "topk_larger_than_block": (["--flexdemo.topk", "5000"], "topk=5000 is larger than a"),
    "dataset_without_its_tokenizer": (
        ["--training.dataset", "c4_test", "--model.hf_assets_path", "/nonexistent/tokenizer"],
        "[model] hf_assets_path '/nonexistent/tokenizer' holds no tokenizer",
    ),
    "bare_sign_outer_values": (
        ["--flexdemo.mode", "demo_diloco", "--flexdemo.outer_value_encoding", "sign"],
        "invalid choice 'sign' for argument '--flexdemo.outer-value-encoding'",
    ),
    "demo_lr_zero": (["--optimizer.lr", "0"], "optimizer.lr=0.0; mode 'demo' needs a finite lr > 0"),
    # flexdemo's held-out windows at this layout (4 data ranks): refused here, not at the first validation
    "heldout_batches_not_splitting_the_windows": (
        ["--validation.enable", "--validation.dataset", "flexdemo_stdlib_validation", "--validation.seq_len", "128",
         "--validation.local_batch_size", "100003"],  # (a prime above any N / 4 of the stdlib's split)
        "held-out windows do not split into batches of 4 data-parallel ranks x local_batch_size 100003",
    ),
    "heldout_steps_beyond_the_set": (
        ["--validation.enable", "--validation.dataset", "flexdemo_stdlib_validation", "--validation.seq_len", "128",
         "--validation.local_batch_size", "2", "--validation.steps", "100000"],
        "[validation] steps 100000 outside 1..",
    ),
    "check_between_outer_steps": (
        ["--flexdemo.mode", "diloco", "--flexdemo.sync_interval", "4"],
        "replica_check_interval=10 must be a multiple of sync_interval=4",
    ),
}

# On 0.3.0 flexdemo's TOML reader, not tyro, refuses a value outside a Literal's choices.
ON_0_3_MESSAGES = {
    "unknown_value": "value_encoding='int4'; expected one of",
    "bare_sign_outer_values": "outer_value_encoding='sign' with mode='demo_diloco'; expected one of",
}


def _check_fails(run, message):
    assert run.returncode == 2, run.output[-3000:]  # the launcher's config-error exit
    flat = " ".join(run.output.replace("│", " ").split())  # undo tyro's box wrapping
    assert message in flat, run.output[-3000:]
    assert "[rank" not in run.output and "step:" not in run.output  # before torchrun started any rank


# Each case through flexdemo.titan.launch.plan as the launcher calls it, its exit code and
# everything it printed (fd 1 and 2: tyro's errors go to the terminal's stream) captured per case.
_PLAN_EVERY_CASE = r"""
import json, os, sys, tempfile
from flexdemo.titan.launch import plan
results = {}
for name, (config, overrides) in json.loads(sys.argv[1]).items():
    with tempfile.TemporaryFile("w+") as f:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(f.fileno(), 1); os.dup2(f.fileno(), 2)
        try:
            plan(config, overrides)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        f.seek(0)
        results[name] = [code, f.read()]
print(json.dumps(results))
"""


class _Checked:
    def __init__(self, returncode, output):
        self.returncode, self.output = returncode, output


@pytest.fixture(scope="module")
def planned(assets, tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    cases = {name: [str(DEMO), ["--job.dump_folder", str(dump), *overrides]] for name, (overrides, _) in CASES.items()}
    env = {**os.environ, "NPROC": "4", "FLEXDEMO_CACHE": cache_holding(assets), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _PLAN_EVERY_CASE, json.dumps(cases)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: _Checked(*result) for name, result in json.loads(proc.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_config_fails_fast(name, planned):
    _check_fails(planned[name], ON_0_3_MESSAGES.get(name, CASES[name][1]) if ON_0_3 else CASES[name][1])


@pytest.mark.parametrize("name", ["replicate_not_dividing_world", "dataset_without_its_tokenizer"])
def test_bad_config_fails_fast_through_the_launcher(name, tmp_path, assets):
    overrides, message = CASES[name]
    run = launch(DEMO, tmp_path / "dump", *overrides, assets=assets, timeout=120)
    _check_fails(run, message)


def test_unknown_flexdemo_key_in_toml(tmp_path, assets):
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace("[flexdemo]\n", "[flexdemo]\ntop_k = 8\n"))
    run = launch(bad, tmp_path / "dump", assets=assets, timeout=120)
    _check_fails(run, "Invalid field names in <class 'flexdemo.section.FlexDemo'> data: {'top_k'}")


def _torchrun(*args):
    import os
    import subprocess
    import sys

    from titan_launch import REPO, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stdout + proc.stderr


@needs_torchtitan_0_2
def test_bad_config_through_torchtitans_own_entry_point(tmp_path):
    """`torchrun -m torchtitan.train`: flexdemo.titan.register (torchtitan's custom_import)
    checks the run's config before torchtitan sets up the process group: one line, from
    rank 0 only, and no traceback from any rank. A value from TOML, which tyro takes as is."""
    bad = tmp_path / "bad.toml"
    bad.write_text(DEMO.read_text().replace('value_encoding = "sign"', 'value_encoding = "int4"'))
    rc, out = _torchrun("-m", "torchtitan.train", "--job.config_file", str(bad))
    assert rc != 0
    line = "flexdemo: [flexdemo] config error: value_encoding='int4'"
    assert out.count(line) == 1, out[-3000:]
    assert "raise FlexDemoConfigError" not in out and "Training starts" not in out, out[-3000:]


@needs_torchtitan_0_2
def test_bad_config_direct_torchrun_without_launcher():
    """The check in flexdemo.titan.run also stops a plain torchrun launch, with one line."""
    rc, out = _torchrun("-m", "flexdemo.titan.run", "--job.config_file", str(DEMO), "--flexdemo.topk", "0")
    assert rc != 0
    assert out.count("topk=0; expected an integer >= 1") == 1, out[-3000:]
