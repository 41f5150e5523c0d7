"""The end-to-end join refusal both torchtitan versions' elastic tests run
(tests/test_titan_elastic.py, tests/test_torchtitan_0_3.py): two replicas of cpu_elastic_demo.toml
over one Lighthouse, the second with another top-k; exactly one is refused at join with one line
naming the setting and both values."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402


def check_join_refused(tmp_path: Path, command: Callable[[int, list[str]], list[str]], env: dict) -> None:
    """``command(replica, extra_flags)``: the command line of one replica (the config, its
    replica_id, ``--checkpoint.no_enable``, its own dump folder, then ``extra_flags``)."""
    port = free_port()
    lighthouse = subprocess.Popen(["bash", str(REPO / "scripts" / "lighthouse.sh"), str(port), "2"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env = {**env, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for replica, extra in ((0, []), (1, ["--flexdemo.topk", "16"])):
            procs.append(subprocess.Popen(command(replica, extra), cwd=REPO,
                                          env={**env, "MASTER_PORT": str(free_port())}, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"r{replica}.err", "w"), start_new_session=True))
        # At step 0 one of the two heals from the other (torchft's init_sync) and compares.
        end = time.time() + 150
        while time.time() < end and all(p.poll() is None for p in procs):
            time.sleep(0.5)
        refused = [r for r, p in enumerate(procs) if p.poll() is not None]
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert len(refused) == 1, "neither replica was refused in time"
    err = (tmp_path / f"r{refused[0]}.err").read_text()
    lines = [x for x in err.splitlines() if "refused at join" in x]
    assert procs[refused[0]].returncode != 0 and len(lines) == 1, err[-3000:]
    theirs, ours = ("32", "16") if refused[0] == 1 else ("16", "32")
    assert f"elastic replica {refused[0]} refused at join: its flexdemo.topk is {ours}, the quorum's is {theirs}" \
        in lines[0]


def check_kill_and_heal(tmp_path: Path, env: dict) -> None:
    """scripts/elastic_demo.sh with ``env`` (its PYTHON runs the replicas): three CPU replicas,
    replica 2 killed at step 17 and restarted from its checkpoint folder at once, in mode demo and
    demo_diloco; it must heal from a live peer after its checkpoint's step and end bitwise equal.
    Its start (imports, checkpoint, heal) takes ~35 of the survivors' steps here, so 100 steps
    leave it ~50 of checks after it rejoined."""
    import re

    r = subprocess.run(["bash", str(REPO / "scripts" / "elastic_demo.sh"), "--out", str(tmp_path), "--steps", "100",
                        "--restart-at", "17", "--timeout", "400", "--no-baseline"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1450)
    lines = r.stdout.strip().splitlines()[-2:]
    for mode, line in zip(("demo", "demo_diloco"), lines):
        m = re.fullmatch(rf"elastic {mode}: survivors took (\d+) steps during the outage; rejoined replica bitwise "
                         r"equal: (yes|no); final loss ([\d.]+) \(uninterrupted not run\)", line)
        assert m, (line, r.stdout[-2000:], r.stderr[-2000:])
        assert m.group(2) == "yes" and int(m.group(1)) >= 5, line
        # the restarted replica loaded its own checkpoint, then took the live peers' later state
        m = re.search(rf"elastic {mode}: replica 2 restarted, loaded its checkpoint of step (\d+), healed from a "
                      r"live peer at step (\d+)", r.stderr)
        assert m and int(m.group(2)) > int(m.group(1)) >= 10, r.stderr[-2000:]
    assert r.returncode == 0 and len(lines) == 2, r.stdout[-2000:]
