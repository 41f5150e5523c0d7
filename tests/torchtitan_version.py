"""Which torchtitan this suite runs on. flexdemo.titan (the 0.2.2 adapter, its TOML layer, the
planner) and flexdemo.titan.v0_3 each have their own tests; on 0.3.x the 0.2.2-only ones skip with
this reason instead of failing on 0.2.2's imports (torchtitan.config.job_config, llama3.Transformer,
build_hf_tokenizer). Tests that launch through scripts/launch.sh run on either version."""

import pytest

from flexdemo.titan.version import TORCHTITAN
from flexdemo.titan.version import V0_2 as ON_0_2
from flexdemo.titan.version import V0_3 as ON_0_3

WHY_0_2 = (f"needs torchtitan 0.2.x (installed: {TORCHTITAN}): flexdemo.titan's 0.2.2 layer; "
           "0.3.x runs tests/test_torchtitan_0_3*.py")
needs_torchtitan_0_2 = pytest.mark.skipif(not ON_0_2, reason=WHY_0_2)
needs_torchtitan_0_3 = pytest.mark.skipif(not ON_0_3, reason=f"needs torchtitan 0.3.x (installed: {TORCHTITAN})")


def skip_module_unless_torchtitan_0_2():
    """For a module that imports 0.2.2-only names at its top: call before those imports."""
    if not ON_0_2:
        pytest.skip(WHY_0_2, allow_module_level=True)
