"""Elastic replicas on one machine, for the demo and the benchmarks: a torchft Lighthouse on
localhost (scripts/lighthouse.sh) and one torchrun job per replica (scripts/launch.sh), each
with its own MASTER_PORT and log; killed as whole process trees (benchmarks/process_tree)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

from ports import free_port
from process_tree import kill_tree
from titan_logs import ANSI

REPO = Path(__file__).resolve().parents[1]
LOGGED_STEP = re.compile(r"step:\s*(\d+)\s+loss:")


def log_text(log: Path) -> str:
    return ANSI.sub("", log.read_text(errors="replace")) if log.exists() else ""


def last_logged_step(log: Path) -> int:
    """The last training step a replica's log shows (torchtitan's ``step: N loss:`` lines)."""
    return max((int(m[1]) for m in LOGGED_STEP.finditer(log_text(log))), default=0)


class Cluster:
    """A Lighthouse and the replicas' torchrun jobs of one run; logs in ``folder``. ``env``: added
    to every process's environment; ``lighthouse_env``: to the Lighthouse's alone."""

    def __init__(self, folder: Path, min_replicas: int, env: dict[str, str] | None = None,
                 lighthouse_env: dict[str, str] | None = None):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "LOG_RANK": "0", **(env or {})}
        self.lighthouse = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "lighthouse.sh"), str(port), str(min_replicas)],
            env={**self.env, **(lighthouse_env or {})}, stdout=open(folder / "lighthouse.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def start(self, name: str, config: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        """``scripts/launch.sh CONFIG ARGS`` as replica job ``name`` (its command in NAME.cmd)."""
        cmd = ["bash", str(REPO / "scripts" / "launch.sh"), str(config), *args]
        (self.folder / f"{name}.cmd").write_text(" ".join(shlex.quote(c) for c in cmd) + "\n")
        self.procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env={**self.env, "MASTER_PORT": str(free_port()), **(env or {})},
            stdout=open(self.log(name), "w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.started[name] = time.time()

    def wait_for_step(self, name: str, step: int, deadline: float) -> None:
        """Until ``name`` has logged ``step``; an error if it ended or ``deadline`` passed first."""
        while time.time() < deadline:
            if last_logged_step(self.log(name)) >= step:
                return
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} ended (exit {self.procs[name].returncode}) before step {step}; "
                                   f"see {self.log(name)}")
            time.sleep(0.2)
        raise TimeoutError(f"{name} did not reach step {step} in time")

    def kill(self, name: str) -> None:
        kill_tree(self.procs[name].pid)  # torchrun and its worker, which sits in a session of its own
        self.procs[name].wait()

    def wait_all(self, deadline: float) -> dict[str, int | None]:
        """Every job's exit code; None for one still running at ``deadline`` (then killed)."""
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            if p.returncode is None:
                try:
                    p.wait(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    kill_tree(p.pid)
                    p.wait()
                    codes[name] = None
                    continue
            codes[name] = p.returncode
        return codes

    def close(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
