"""benchmarks/profiling/cuda_sync_debug/sitecustomize.py counts a rank's host-GPU syncs by Python stack. Its
counting is checked here with a stand-in for torch.cuda (no GPU): a warning of the kind torch's
sync debug mode raises is recorded with the stack that raised it; other warnings pass through."""

import importlib.util
import os
import types
import warnings

from titan_launch import REPO

SITE = REPO / "benchmarks" / "profiling" / "cuda_sync_debug" / "sitecustomize.py"


def _load_without_side_effects():
    spec = importlib.util.spec_from_file_location("cuda_sync_debug_site", SITE)
    module = importlib.util.module_from_spec(spec)
    saved = os.environ.pop("RANK", None)  # the module installs itself only in a torchrun worker
    try:
        spec.loader.exec_module(module)
    finally:
        if saved is not None:
            os.environ["RANK"] = saved
    return module


def flexdemo_sync_site():  # a frame outside torch and the standard library: kept in the stack
    warnings.warn("called a synchronizing CUDA operation")


def test_sync_warnings_are_counted_by_stack_and_written(tmp_path, monkeypatch):
    site = _load_without_side_effects()
    modes = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(set_sync_debug_mode=modes.append))
    exits = []
    monkeypatch.setattr(site.atexit, "register", exits.append)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("CUDA_SYNC_DEBUG_DIR", str(tmp_path))
    with warnings.catch_warnings(record=True) as shown:  # what reaches the screen
        warnings.resetwarnings()
        warnings.simplefilter("default")  # Python's own: each location once; syncs must count every time
        site._install(fake_torch)
        for _ in range(3):
            flexdemo_sync_site()
        warnings.warn("something else")
    assert modes == ["warn"]
    assert [str(w.message) for w in shown] == ["something else"]  # syncs counted, not shown
    (write,) = exits
    write()
    report = (tmp_path / "rank3.txt").read_text()
    assert report.startswith("3 syncs from:\n")
    assert "flexdemo_sync_site" in report and "test_cuda_sync_debug.py" in report
