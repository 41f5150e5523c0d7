"""benchmarks/process_tree.kill_tree stops a launcher together with workers in sessions of their own
(what torchrun does), so a timed-out job leaves nothing running."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from titan_launch import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from process_tree import descendants, kill_tree  # noqa: E402

# A launcher like torchrun: one worker per "rank", each in a new session, and a grandchild below
# one of them; it prints the workers' pids and waits.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    inner = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    workers = [subprocess.Popen([sys.executable, "-c", inner], start_new_session=True) for _ in range(2)]
    print(" ".join(str(w.pid) for w in workers), flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not reaped
    except FileNotFoundError:
        return False


def wait_until(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_kill_tree_stops_workers_in_their_own_sessions():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    tree: list[int] = []
    try:
        workers = [int(p) for p in launcher.stdout.readline().split()]
        assert len(workers) == 2
        assert wait_until(lambda: len(descendants(launcher.pid)) == 4)  # 2 workers + their 2 sleeps
        tree = descendants(launcher.pid)
        assert set(workers) <= set(tree)
        kill_tree(launcher.pid)
        launcher.wait(timeout=10)
        assert wait_until(lambda: not any(alive(p) for p in tree)), [p for p in tree if alive(p)]
    finally:  # whatever kill_tree left behind (a broken one must not leak sleeping processes)
        for pid in [launcher.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


def test_kill_tree_of_a_finished_process_is_harmless():
    done = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    done.wait()
    kill_tree(done.pid)  # no error: nothing left to stop
