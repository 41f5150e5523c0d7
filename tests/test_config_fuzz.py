"""Fuzzing the config surface: random (seeded) values for every [flexdemo] key and the mesh
degrees, written as TOML (which tyro does not check) or given as CLI flags (which it does).
Every case either passes flexdemo's checks or fails with one readable line naming what is
wrong, never another exception; a few cases of each kind are launched for real: a passing one
trains, a failing one exits non-zero with that line and no traceback, none hangs."""

import math
import random
import re

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from titan_launch import CONFIGS, launch

BASE = (CONFIGS / "cpu_2x2_flexdemo.toml").read_text()
WORLD = 4
CASES = 160  # each is one torchtitan config parse (~0.35 s of tyro on a CI core)
SEED = 20261126

# Per key: (values that pass on their own, values that do not: types, ranges, choices).
POOL = {
    "mode": (["demo", "off", "diloco", "demo_diloco"], ["DEMO", "", "hsdp"]),
    "topk": ([1, 8, 32, 4096], [5000, 0, -1, "8", 2.5, True]),
    "chunk": ([16, 32, 64], [0, -8, "64", 64.0]),
    "decay": ([0.0, 0.5, 0.999], [1.0, -0.1, "a", math.inf, math.nan]),
    "value_encoding": (["fp32", "bf16", "sign", "scaled_sign"], ["int4", 3]),
    "weight_decay": ([0, 0.1], [-1.0, math.nan]),
    "overlap": ([True, False], ["yes", 1]),
    "kernel_precision": (["ieee", "tf32x3"], ["tf32"]),
    "replica_check_interval": ([0, 10], [-1, 2.5]),
    "replica_check_action": (["stop", "resync"], ["ignore"]),
    "init_sync": (["broadcast", "verify", "none"], ["all"]),
    "nonfinite": (["skip", "stop"], ["warn"]),
    "exchange_timeout_seconds": ([0, 2.5, 600], [-1, math.inf]),
    "sync_interval": ([1, 5, 10], [0, -3, 1.5]),
    "outer_lr": ([0.7, 1e-3], [0, -1.0, math.inf]),
    "outer_momentum": ([0.5, 0.9], [1.0, -0.5]),
    "outer_nesterov": ([True, False], ["false"]),
    "outer_value_encoding": (["fp32", "bf16", "scaled_sign"], ["sign", "int8"]),
    "outer_topk": ([1, 32, 4096], [5000, 0]),
    "outer_chunk": ([8, 64], [0]),
    "outer_decay": ([0.0, 0.9, 1.0], [1.5, -0.1]),
    "outer_state_device": (["device", "cpu"], ["gpu"]),
    "outer_transform": (["dct", "none"], ["fft", 0]),
    "momentum_dtype": (["float32", "bfloat16"], ["float16", "bf16"]),
    "momentum_device": (["device", "cpu"], ["gpu"]),
    "exchange": (["allgather", "sharded"], ["ring"]),
    "index_coding": (["fixed", "elias_fano"], ["huffman"]),
    "sharded_topk": ([0, 16], [-1, "16"]),
    "max_consecutive_skips": ([0, 3], [-1, 1.5]),
    "memory_check": (["warn", "off"], ["strict"]),
}
# (replicate, shard, tp) for 4 ranks: most fit, some do not.
MESHES = [(2, 2, 1), (2, -1, 1), (4, 1, 1), (4, -1, 1), (1, 4, 1), (1, -1, 1),
          (3, 1, 1), (2, 3, 1), (0, 4, 1), (2, 0, 1), (2, 1, 2), (4, 2, 1)]
BAD_VALUE = 0.15  # chance that a key gets a value that cannot pass


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _case(rng: random.Random):
    keys = rng.sample(sorted(POOL), rng.randint(1, 6))
    flex = {k: rng.choice(POOL[k][1] if rng.random() < BAD_VALUE else POOL[k][0]) for k in keys}
    replicate, shard, tp = rng.choice(MESHES)
    mesh = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
            "tensor_parallel_degree": tp}
    return flex, mesh


def _config(flex, mesh) -> str:
    text = re.sub(r"\[flexdemo\]\n(?:[^\[]*\n)*?\n", "[flexdemo]\n" + "".join(
        f"{k} = {_toml(v)}\n" for k, v in flex.items()) + "\n", BASE, count=1)
    par = "".join(f"{k} = {v}\n" for k, v in mesh.items())
    return re.sub(r"\[parallelism\]\n(?:[^\[]*\n)*?\n", "[parallelism]\n" + par + "\n", text, count=1)


def _check(path, world=WORLD):
    """The check every launch runs first: None when the config passes, else the one line."""
    from flexdemo.titan.config import FlexDemoConfigError
    from flexdemo.titan.entry import check_config

    try:
        check_config(["--job.config_file", str(path)], world)
    except FlexDemoConfigError as e:
        return str(e)
    return None


def _cases():
    rng = random.Random(SEED)
    return [_case(rng) for _ in range(CASES)]


def test_every_case_passes_or_fails_with_one_line(tmp_path):
    outcomes = {"pass": 0, "fail": 0}
    for i, (flex, mesh) in enumerate(_cases()):
        path = tmp_path / f"case{i}.toml"
        path.write_text(_config(flex, mesh))
        try:
            said = _check(path)
        except Exception as e:  # anything but a config error is a bug of the checks
            pytest.fail(f"case {i} {flex} {mesh}: {type(e).__name__}: {e}")
        if said is None:
            outcomes["pass"] += 1
            continue
        outcomes["fail"] += 1
        assert "\n" not in said and said.startswith("[flexdemo] config error: "), said
        # It names what is wrong: a key of the case, or the mesh against the world size.
        assert any(k in said for k in [*flex, *mesh]) or "world size" in said, (said, flex, mesh)
    # Both kinds are well represented (the pools are not all one or the other).
    assert outcomes["pass"] > CASES / 10 and outcomes["fail"] > CASES / 10, outcomes


def test_cli_values_of_the_wrong_type_are_rejected_by_tyro(capsys):
    from torchtitan.config import ConfigManager

    for flag, value in [("--flexdemo.topk", "x"), ("--flexdemo.mode", "hsdp"), ("--flexdemo.overlap", "maybe"),
                        ("--flexdemo.decay", "fast")]:
        with pytest.raises(SystemExit):
            ConfigManager().parse_args(["--job.config_file", str(CONFIGS / "cpu_2x2_flexdemo.toml"), flag, value])
        assert value in capsys.readouterr().err


def _launched_cases():
    """Two passing and two failing cases, the first of each in the seeded sequence (passing ones
    without tensor parallelism: torchtitan's TP is not what this project runs on CPU)."""
    passing, failing = [], []
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        for i, (flex, mesh) in enumerate(_cases()):
            path = Path(tmp) / "c.toml"
            path.write_text(_config(flex, mesh))
            if _check(path) is not None:
                failing.append((i, flex, mesh))
            elif mesh["tensor_parallel_degree"] == 1:
                passing.append((i, flex, mesh))
            if len(passing) >= 2 and len(failing) >= 2:
                break
    return passing[:2] + failing[:2]


@pytest.mark.parametrize("index,flex,mesh", _launched_cases(), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_launched_cases_train_or_exit_with_one_line(tmp_path, assets, index, flex, mesh):
    path = tmp_path / "case.toml"
    path.write_text(_config(flex, mesh))
    expected = _check(path)
    run = launch(path, tmp_path / "dump", "--training.steps", "2", assets=assets, timeout=300)
    if expected is None:
        assert run.returncode == 0, run.output[-4000:]
        assert sorted(run.losses(0)) == [1, 2]
    else:
        assert run.returncode == 2, run.output[-4000:]
        assert run.output.count("config error") == 1 and "Traceback" not in run.output, run.output[-4000:]
