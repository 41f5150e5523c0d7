import os
import sys

# Tests import their helpers (multiproc, reference_demo) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """The embedded corpus + tokenizer, built once for every test that launches training."""
    from flexdemo.data import ensure_assets

    return ensure_assets(tmp_path_factory.mktemp("assets") / "stdlib")
