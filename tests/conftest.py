import os
import sys
import tempfile

# Tests import their helpers (multiproc, reference_demo) as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The runs tests start through scripts/launch.sh or elastic_demo.sh run their ranks with $PYTHON: the
# interpreter running the tests, not whichever python3 PATH finds first (a venv not activated).
os.environ["PYTHON"] = sys.executable
# flexdemo's default asset cache: one per test session, not the user's home.
os.environ.setdefault("FLEXDEMO_CACHE", tempfile.mkdtemp(prefix="flexdemo-test-cache-"))


import pytest  # noqa: E402


def pytest_sessionstart(session):
    """``FLEXDEMO_TORCHTITAN=0.3`` (scripts/run_tests.sh's run on torchtitan 0.3.0): stop at once
    when another version is installed, rather than let that version's tests skip unseen."""
    import importlib.metadata

    wanted = os.environ.get("FLEXDEMO_TORCHTITAN")
    installed = importlib.metadata.version("torchtitan")
    if wanted and not installed.startswith(wanted):
        raise pytest.UsageError(f"FLEXDEMO_TORCHTITAN={wanted} but torchtitan {installed} is installed")


@pytest.fixture(scope="session")
def assets():
    """The embedded corpus + tokenizer (in the session's cache), built once for every test
    that launches training."""
    from flexdemo.data import ensure_assets

    return ensure_assets()
