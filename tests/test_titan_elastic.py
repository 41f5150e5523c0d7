"""Elastic replicas through torchtitan (flexdemo.titan.elastic): the [fault_tolerance] checks,
an unreachable Lighthouse, and scripts/elastic_demo.sh end to end (three CPU replicas, one
killed and restarted), whose closing line is the one the docs show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from titan_launch import CONFIGS, LAUNCH, REPO

pytest.importorskip("torchft")
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402


def _job(*overrides):
    from torchtitan.config import ConfigManager

    import flexdemo.titan.register  # noqa: F401

    return ConfigManager().parse_args(["--job.config_file", str(CONFIGS / "cpu_elastic_demo.toml"), *overrides])


@pytest.mark.parametrize("overrides,env,match", [
    ([], None, r"needs \$TORCHFT_LIGHTHOUSE=http://HOST:PORT"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "x", r"data_parallel_replicate_degree must be 1"),
    (["--flexdemo.mode", "diloco"], "x", r"mode='diloco' cannot run elastic replicas yet"),
    (["--flexdemo.overlap"], "x", r"turn overlap off"),
    (["--flexdemo.exchange", "sharded"], "x", r"only 'allgather' runs over torchft"),
    (["--fault_tolerance.replica_id", "3"], "x", r"0 <= replica_id < group_size"),
    (["--fault_tolerance.min_replica_size", "4"], "x", r"min_replica_size=4"),
    (["--fault_tolerance.semi_sync_method", "diloco"], "x", r"torchtitan's own DiLoCo"),
])
def test_fault_tolerance_keys_are_checked_before_anything_starts(overrides, env, match, monkeypatch):
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    if env:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", env)
    with pytest.raises(FlexDemoConfigError, match=match):
        validate_job_config(_job(*overrides), None)  # no world size: the [fault_tolerance] checks alone


def test_fault_tolerance_in_a_mode_off_run_is_refused_not_ignored(monkeypatch):
    # the stock Trainer would not read [fault_tolerance] at all
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "x")
    with pytest.raises(FlexDemoConfigError, match="mode='off' cannot run elastic"):
        validate_job_config(_job("--flexdemo.mode", "off"), 1)


@pytest.mark.timeout(120)
def test_an_unreachable_lighthouse_ends_the_replica_with_one_line(tmp_path, assets):
    address = f"http://localhost:{free_port()}"  # nothing listens there
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": address, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    start = time.time()
    r = subprocess.run(["bash", str(LAUNCH), str(CONFIGS / "cpu_elastic_demo.toml"),
                        "--fault_tolerance.process_group_timeout_ms", "3000", "--model.hf_assets_path", str(assets),
                        "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=110)
    lines = [x for x in r.stderr.splitlines() if "flexdemo: the Lighthouse" in x]  # torchrun prefixes [rank0]:
    assert r.returncode != 0 and len(lines) == 1, r.stderr[-3000:]
    assert f"the Lighthouse at {address} ($TORCHFT_LIGHTHOUSE) did not answer within 3 s" in lines[0]
    assert time.time() - start < 100


@pytest.mark.timeout(900)
def test_elastic_demo_survives_a_killed_replica_and_heals_it_bitwise(tmp_path, assets):
    env = {**os.environ, "FLEXDEMO_CACHE": os.environ["FLEXDEMO_CACHE"]}
    r = subprocess.run(["bash", str(REPO / "scripts" / "elastic_demo.sh"), "--out", str(tmp_path), "--steps", "100",
                        "--timeout", "400"], cwd=REPO, env=env, capture_output=True, text=True, timeout=880)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = re.fullmatch(r"elastic demo: survivors took (\d+) steps during the outage; rejoined replica bitwise "
                     r"equal: (yes|no); final loss ([\d.]+) \(uninterrupted ([\d.]+)\)", line)
    assert m, (line, r.stdout[-2000:], r.stderr[-2000:])
    assert r.returncode == 0 and m.group(2) == "yes" and int(m.group(1)) >= 5, line
