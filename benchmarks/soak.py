"""A long CPU soak of the tiny 2 replicas x 2 shards config, with one rank killed on the way.

  python3 benchmarks/soak.py --steps 1000 --kill-at 550 --out outputs/soak [-- --flexdemo.mode diloco ...]

Trains ``--steps`` steps through scripts/launch.sh with checkpoints every ``--ckpt`` steps and
the replica check every ``--check`` steps (a mismatch stops the run), SIGKILLs local rank 2
once the job passes step ``--kill-at`` (torchrun, MAX_RESTARTS=1, restarts the job from the last
checkpoint), and then reports from every rank's logs: replica checks passed, peak memory per
100 steps (the CPU shim logs the process's peak RSS), the distinct bytes per step, the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from titan_launch import free_port, worker_pid  # noqa: E402  (shared with the kill-restart test)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r" - INFO - step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([\d.]+)GiB")
XCHG = re.compile(r"flexdemo step:\s*(\d+)\s+sent_bytes:\s*(\d+)\s+received_bytes:\s*(\d+)")
CHECK = re.compile(r"replicas identical at step (\d+) \(local param digest (\w+)\)")


def rank_lines(log_dir: Path, rank: int) -> list[tuple[str, str]]:
    """(attempt, line) of one local rank, every attempt in order."""
    out = []
    for f in sorted(log_dir.glob(f"*/attempt_*/{rank}/stdout.log")):
        attempt = f.parts[-3]
        out += [(attempt, ANSI.sub("", line)) for line in f.read_text(errors="replace").splitlines()]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--kill-at", type=int, default=550)
    ap.add_argument("--ckpt", type=int, default=100)
    ap.add_argument("--check", type=int, default=50)
    ap.add_argument("--config", default="train_configs/cpu_2x2_flexdemo.toml")
    ap.add_argument("--out", default="outputs/soak")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out = Path(args.out).absolute()
    dump, log_dir = out / "dump", out / "logs"
    env = {**os.environ, "NPROC": "4", "MAX_RESTARTS": "1", "LOG_RANK": "0", "LOG_DIR": str(log_dir),
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    cmd = ["bash", str(REPO / "scripts" / "launch.sh"), args.config, "--job.dump_folder", str(dump),
           "--metrics.disable_color_printing", "--metrics.log_freq", "10", "--training.steps", str(args.steps),
           "--checkpoint.enable", "--checkpoint.interval", str(args.ckpt), "--checkpoint.keep_latest_k", "2",
           "--flexdemo.replica_check_interval", str(args.check), *extra]
    start = time.time()
    job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                           start_new_session=True)
    killed_at = None
    while job.poll() is None:
        time.sleep(5)
        if killed_at is None:
            steps = [int(m.group(1)) for _, line in rank_lines(log_dir, 2) if (m := STEP.search(line))]
            if steps and max(steps) >= args.kill_at and (pid := worker_pid(dump, 2)) is not None:
                os.kill(pid, signal.SIGKILL)
                killed_at = max(steps)
                print(f"killed local rank 2 (pid {pid}) after step {killed_at}", flush=True)
    wall = time.time() - start
    report = {"returncode": job.returncode, "wall_seconds": round(wall), "killed_after_step": killed_at,
              "steps": args.steps, "extra_args": extra}
    lines = rank_lines(log_dir, 0)
    attempts = sorted({a for a, _ in lines})
    losses, memory, sent = {}, {}, set()
    for _, line in lines:
        if m := STEP.search(line):
            losses[int(m.group(1))] = float(m.group(2))
            memory[int(m.group(1))] = float(m.group(3))
        if m := XCHG.search(line):
            sent.add(int(m.group(2)))
    checks = {}
    for rank in range(4):
        for _, line in rank_lines(log_dir, rank):
            if m := CHECK.search(line):
                checks.setdefault(int(m.group(1)), {})[rank] = m.group(2)
    identical = all(len(d) == 4 and d[0] == d[2] and d[1] == d[3] for d in checks.values())
    report.update(
        attempts=attempts, last_step=max(losses, default=0), replica_checks=len(checks),
        replica_checks_all_identical=identical,
        peak_memory_gib_every_100_steps={s: memory[s] for s in sorted(memory) if s % 100 == 0},
        distinct_bytes_sent_per_step=sorted(sent),
        loss_first_last={"first": losses.get(1), "last": losses.get(max(losses, default=0))},
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if job.returncode == 0 and identical and killed_at else 1


if __name__ == "__main__":
    sys.exit(main())
