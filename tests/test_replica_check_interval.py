"""replica_check_interval's default ("auto") and the benchmark its number comes from
(benchmarks/replica_check.py, here at CI size on CPU)."""

import json
import os
import re
import subprocess
import sys

import pytest

from titan_launch import CONFIGS, REPO
from torchtitan_version import needs_torchtitan_0_2


def _job(tmp_path, config, *overrides):
    """``config`` with its replica_check_interval line removed (the default applies), parsed."""
    from torchtitan.config import ConfigManager

    text = re.sub(r"(?m)^replica_check_interval = .*\n", "", (CONFIGS / config).read_text())
    path = tmp_path / config
    path.write_text(text)
    return ConfigManager().parse_args(["--job.config_file", str(path), *overrides])


@needs_torchtitan_0_2
@pytest.mark.parametrize("config,overrides,steps", [
    ("cpu_2x2_flexdemo.toml", [], 100),
    ("cpu_2x2_hsdp_adamw.toml", [], 100),
    # DiLoCo: params + global copy + momentum = 3 x 100 steps, a multiple of H.
    ("cpu_2x2_diloco.toml", ["--flexdemo.sync_interval", "128"], 384),
    ("cpu_2x2_diloco.toml", ["--flexdemo.sync_interval", "100"], 300),
    ("cpu_2x2_diloco.toml", ["--flexdemo.sync_interval", "1000"], 1000),
    # No outer momentum, state on the host (3x a device tensor): 100 x (1 + 3) = 400.
    ("cpu_2x2_demo_diloco.toml", ["--flexdemo.sync_interval", "16", "--flexdemo.outer_momentum", "0",
                                  "--flexdemo.no-outer-nesterov", "--flexdemo.outer_state_device", "cpu"], 400),
    ("cpu_2x2_flexdemo.toml", ["--flexdemo.replica_check_interval", "auto"], 100),
    ("cpu_2x2_flexdemo.toml", ["--flexdemo.replica_check_interval", "7"], 7),
])
def test_auto_interval_resolves_to_a_valid_number_of_steps(tmp_path, config, overrides, steps):
    from flexdemo.titan.config import validate_job_config

    job = _job(tmp_path, config, *overrides)
    assert job.flexdemo.replica_check_interval == ("auto" if "7" not in overrides else 7)
    validate_job_config(job, 4)
    assert job.flexdemo.replica_check_interval == steps


@needs_torchtitan_0_2
def test_a_word_other_than_auto_is_refused(tmp_path):
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    path = tmp_path / "c.toml"
    path.write_text((CONFIGS / "cpu_2x2_flexdemo.toml").read_text().replace(
        "replica_check_interval = 10", 'replica_check_interval = "often"'))
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    with pytest.raises(FlexDemoConfigError, match='replica_check_interval=\'often\'; expected an integer or "auto"'):
        validate_job_config(job, 4)


def test_bench_replica_check_runs_at_ci_size():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks" / "replica_check.py"), "--scale", "0.01", "--iters", "2",
           "--copies", "2", "--step-ms", "10"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])  # one JSON line
    assert result["tensors"] == 2 * 147 and result["elements"] > 0 and result["check_ms"] > 0
    ms = result["check_ms"]
    assert result["share_of_step_at_interval"]["100"] == pytest.approx(ms / 1000, rel=1e-3, abs=1e-5)
    n = result["smallest_interval_within_0.5%"]
    assert ms / (n * 10) <= 0.005 < ms / ((n - 1) * 10) if n > 1 else ms / 10 <= 0.005
