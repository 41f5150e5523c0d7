import os
import sys
import tempfile

# Tests import their helpers (multiproc, reference_demo) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# flexdemo's default asset cache: one per test session, not the user's home.
os.environ.setdefault("FLEXDEMO_CACHE", tempfile.mkdtemp(prefix="flexdemo-test-cache-"))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def assets():
    """The embedded corpus + tokenizer (in the session's cache), built once for every test
    that launches training."""
    from flexdemo.data import ensure_assets

    return ensure_assets()
