"""Every shipped train config parses, passes flexdemo's validation for the world size it
is meant for, and names a registered spec + flavor (no GPU needed)."""

import pytest

from titan_launch import CONFIGS

# world size each config is written for (multi-node templates: 2 nodes x 8 GPUs)
WORLD = {"cpu_2x2": 4, "gpu_2gpu": 2, "gpu_4gpu": 4, "multinode": 16}


def _world(name: str) -> int:
    return next(w for prefix, w in WORLD.items() if name.startswith(prefix))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_config_is_valid(path):
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
    assert job.flexdemo.mode == ("off" if "adamw" in path.stem else "demo")


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
