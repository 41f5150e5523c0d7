"""Elastic replicas through torchtitan (flexdemo.titan.elastic): the [fault_tolerance] checks,
an unreachable Lighthouse, a joining replica whose settings differ, and scripts/elastic_demo.sh
end to end (three CPU replicas, one killed and restarted from its checkpoint folder, in the
per-step mode and in demo_diloco), whose closing lines are the ones the docs show."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from titan_launch import CONFIGS, LAUNCH, REPO
from torchtitan_version import needs_torchtitan_0_2

pytest.importorskip("torchft")
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402


def _job(*overrides):
    from torchtitan.config import ConfigManager

    import flexdemo.titan.register  # noqa: F401

    return ConfigManager().parse_args(["--job.config_file", str(CONFIGS / "cpu_elastic_demo.toml"), *overrides])


@needs_torchtitan_0_2
@pytest.mark.parametrize("overrides,env,match", [
    ([], None, r"needs \$TORCHFT_LIGHTHOUSE=http://HOST:PORT"),
    (["--parallelism.data_parallel_replicate_degree", "2"], "x", r"data_parallel_replicate_degree must be 1"),
    (["--flexdemo.overlap"], "x", r"turn overlap off"),
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


@needs_torchtitan_0_2
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


@needs_torchtitan_0_2
def test_a_replica_is_refused_at_join_naming_the_setting_it_does_not_share():
    from flexdemo.elastic.group import ElasticJoinError
    from flexdemo.titan.config import run_settings
    from flexdemo.titan.elastic import refuse_if_different

    def join_settings(job_config):
        return run_settings(job_config).items()

    quorum = join_settings(_job())
    names = [k for k, _ in quorum]
    assert "flexdemo.topk" in names and "torch version" in names and "fault_tolerance.group_size" in names
    assert not any("replica_id" in k or "dump_folder" in k for k in names)  # each replica's own
    refuse_if_different(join_settings(_job("--fault_tolerance.replica_id", "2")), quorum, 2)  # no error
    with pytest.raises(ElasticJoinError, match=r"replica 2 refused at join: its flexdemo.topk is 16, the quorum's "
                                               r"is 32"):
        refuse_if_different(join_settings(_job("--flexdemo.topk", "16")), quorum, 2)


@pytest.mark.timeout(200)
def test_a_joining_replica_with_other_settings_is_refused_and_says_which(tmp_path, assets):
    from elastic_join import check_join_refused

    def command(replica, extra):
        return ["bash", str(LAUNCH), str(CONFIGS / "cpu_elastic_demo.toml"), "--fault_tolerance.replica_id",
                str(replica), "--model.hf_assets_path", str(assets), "--checkpoint.no_enable",
                "--job.dump_folder", str(tmp_path / f"r{replica}"), *extra]

    check_join_refused(tmp_path, command, dict(os.environ))


@pytest.mark.timeout(1500)
def test_elastic_demo_survives_a_killed_replica_and_heals_it_bitwise(tmp_path, assets):
    from elastic_join import check_kill_and_heal

    check_kill_and_heal(tmp_path, {**os.environ, "FLEXDEMO_CACHE": os.environ["FLEXDEMO_CACHE"]})
