"""Every shipped train config parses, passes flexdemo's validation for the world size it
is meant for, and names a registered spec + flavor (no GPU needed)."""

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from titan_launch import CONFIGS

# world size each config is written for (multi-node templates: 2 nodes x 8 GPUs)
WORLD = {"cpu_2x2": 4, "cpu_elastic": 1, "gpu_2gpu": 2, "gpu_4gpu": 4, "multinode": 16}


def _world(name: str) -> int:
    return next(w for prefix, w in WORLD.items() if name.startswith(prefix))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_config_is_valid(path, monkeypatch):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")  # elastic configs name their Lighthouse
    import flexdemo.titan.register  # noqa: F401
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    from flexdemo.titan.config import validate_job_config

    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    validate_job_config(job, _world(path.stem))
    assert job.job.custom_config_module == "flexdemo.titan.config"
    assert job.experimental.custom_import == "flexdemo.titan.register"
    spec = get_train_spec(job.model.name)
    assert job.model.flavor in spec.model_args
    assert job.flexdemo.mode == _mode(path.stem)


def _mode(stem: str) -> str:
    for part, mode in (("adamw", "off"), ("demo_diloco", "demo_diloco"), ("sparseloco", "demo_diloco"),
                       ("diloco", "diloco")):
        if part in stem:
            return mode
    return "demo"


def test_validation_rejects_bad_world_size():
    from torchtitan.config import ConfigManager

    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = ConfigManager().parse_args(["--job.config_file", str(CONFIGS / "cpu_2x2_flexdemo.toml")])
    with pytest.raises(FlexDemoConfigError, match="does not divide the world size 5"):
        validate_job_config(job, 5)
    with pytest.raises(FlexDemoConfigError, match=r"shard\(2\) x tp\*pp\*cp\(1\) != world size 6"):
        validate_job_config(job, 6)
    with pytest.raises(FlexDemoConfigError, match="data_parallel_replicate_degree >= 2"):
        job.parallelism.data_parallel_replicate_degree = 1
        job.parallelism.data_parallel_shard_degree = -1
        validate_job_config(job, 4)


@pytest.mark.parametrize("lr", ["0", "-1e-3", "inf"])
def test_demo_lr_checked_before_any_rank_starts(lr):
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = _job("--optimizer.lr", lr, config="cpu_2x2_flexdemo.toml")
    with pytest.raises(FlexDemoConfigError, match=r"optimizer.lr=.*mode 'demo' needs a finite lr > 0"):
        validate_job_config(job, 4)
    validate_job_config(_job("--optimizer.lr", "1e-3", config="cpu_2x2_flexdemo.toml"), 4)


def test_flexdemos_held_out_splits_are_not_continued():
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    job = _job("--validation.enable", "--validation.dataset", "flexdemo_stdlib_validation",
               "--flexdemo.no-validation-same-batches", config="cpu_2x2_flexdemo.toml")
    with pytest.raises(FlexDemoConfigError, match="validation_same_batches=false .* fixed windows"):
        validate_job_config(job, 4)
    job = _job("--validation.enable", "--validation.dataset", "c4_validation", "--flexdemo.no-validation-same-batches",
               config="cpu_2x2_flexdemo.toml")
    validate_job_config(job, 4)  # torchtitan's datasets: its own continuing loader, as asked


def _job(*overrides, config="cpu_2x2_diloco.toml"):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(CONFIGS / config), *overrides])


@pytest.mark.parametrize("overrides,match", [
    (["--flexdemo.sync_interval", "0"], "sync_interval=0; expected an integer >= 1"),
    (["--flexdemo.outer_lr", "0"], "outer_lr=0.0; expected > 0"),
    (["--flexdemo.outer_momentum", "1.0"], "outer_momentum=1.0"),
    (["--flexdemo.outer_momentum", "0"], "outer_nesterov=true needs outer_momentum > 0"),
    (["--flexdemo.outer_value_encoding", "sign"], "invalid choice 'sign'"),  # tyro: a Literal
    (["--flexdemo.outer_value_encoding", "scaled_sign"], "with mode='diloco'; expected one of ('fp32', 'bf16')"),
    (["--flexdemo.outer_topk", "5000"], "outer_topk=5000; expected an integer in [1, outer_chunk**2=4096]"),
    (["--flexdemo.outer_decay", "1.5"], "outer_decay=1.5"),
    (["--flexdemo.outer_state_device", "nvme"], "invalid choice 'nvme'"),
    (["--flexdemo.replica_check_interval", "7"], "must be a multiple of sync_interval=5"),
    (["--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "4"],
     "mode='diloco' needs parallelism.data_parallel_replicate_degree >= 2"),
])
def test_diloco_validation(overrides, match, capsys):
    from flexdemo.titan.config import FlexDemoConfigError, validate_job_config

    # Checks of the [flexdemo] section alone run while tyro parses (it prints them and exits);
    # checks across sections run in validate_job_config.
    with pytest.raises((FlexDemoConfigError, SystemExit)) as err:
        validate_job_config(_job(*overrides), 4)
    said = " ".join((str(err.value) + capsys.readouterr().err).replace("│", " ").split())
    assert match in said, said[-2000:]


def test_outer_keys_follow_the_mode():
    from flexdemo.titan.config import validate_job_config

    # scaled_sign is for the compressed outer exchange; plain SGD needs nesterov off.
    validate_job_config(_job("--flexdemo.outer_value_encoding", "scaled_sign", config="cpu_2x2_demo_diloco.toml"), 4)
    validate_job_config(_job("--flexdemo.outer_momentum", "0", "--flexdemo.no-outer-nesterov"), 4)


def test_outer_sign_from_toml_is_refused_with_the_reason():
    # TOML values reach the section unchecked by tyro; validation says why a bare sign is wrong.
    from flexdemo.titan.config import FlexDemo, FlexDemoConfigError, check_section

    with pytest.raises(FlexDemoConfigError, match="a bare sign would move every weight by outer_lr"):
        check_section(FlexDemo(mode="demo_diloco", outer_value_encoding="sign"))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_configs_set_only_keys_their_mode_reads(path):
    from flexdemo.titan.optimizer import ignored_keys

    assert ignored_keys(_job(config=path.name)) == []


@pytest.mark.parametrize("config,overrides,expected", [
    ("cpu_2x2_flexdemo.toml", ["--optimizer.eps", "1e-6", "--flexdemo.outer_lr", "0.5"],
     ["flexdemo.outer_lr", "optimizer.eps"]),
    ("cpu_2x2_diloco.toml", ["--flexdemo.topk", "8", "--flexdemo.outer_topk", "8"],
     ["flexdemo.topk", "flexdemo.outer_topk"]),
    ("cpu_2x2_hsdp_adamw.toml", ["--flexdemo.init_sync", "verify", "--flexdemo.sync_interval", "7"],
     ["flexdemo.init_sync", "flexdemo.sync_interval"]),
    ("cpu_2x2_demo_diloco.toml", ["--optimizer.eps", "1e-6"], []),  # AdamW reads it here
])
def test_keys_the_mode_ignores_are_named(config, overrides, expected):
    from flexdemo.titan.optimizer import ignored_keys

    assert ignored_keys(_job(*overrides, config=config)) == expected
