"""Elastic replicas, shown on CPU: a Lighthouse on localhost (scripts/lighthouse.sh), three
replicas of train_configs/cpu_elastic_demo.toml (one process each, gloo, a checkpoint every 10
steps), replica 2 killed (SIGKILL) at about step 15, once it has written a checkpoint, and started
again at about step 25 in its own folder: it loads its last checkpoint, then heals from a live
peer at the peers' step; then (unless --no-baseline) the same run untouched, for its final loss.

  python3 scripts/elastic_demo.py [--modes demo,demo_diloco] [--out outputs/elastic_demo] [--steps 150] [--no-baseline]

Ends with one line per mode (tools read it):
  elastic <mode>: survivors took <N> steps during the outage; rejoined replica bitwise equal: yes|no; final loss <x> (uninterrupted <y>|not run)

N: steps replica 0 took after the kill and before the restarted replica's first check.
Bitwise equal: at every check the restarted replica logged, its digest is replica 0's at that
step (each replica's own all_gathered check also passed): of the parameters in the per-step
mode, checked every step; of the global copy and outer momentum in the DiLoCo modes, checked
at every outer step (their parameters are the global copy right after one). Final loss:
replica 0's training loss at the last step (a batch of its own shard). Exits 1 if anything
failed. Before them, one line per mode on stderr: the checkpoint step the restarted replica
loaded and the step it healed at from a live peer.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from elastic_cluster import Cluster, last_logged_step, log_text  # noqa: E402

CONFIG = REPO / "train_configs" / "cpu_elastic_demo.toml"
# The config is the per-step mode's; demo_diloco: AdamW inside each replica, an outer step every 5.
MODE_FLAGS = {
    "demo": [],
    # SparseLoCo's outer step (plain SGD, lr 1): with H = 5, outer momentum 0.9 diverged here.
    "demo_diloco": ["--flexdemo.mode", "demo_diloco", "--flexdemo.sync_interval", "5", "--flexdemo.outer_topk", "32",
                    "--flexdemo.outer_value_encoding", "scaled_sign", "--flexdemo.outer_momentum", "0",
                    "--flexdemo.outer_lr", "1.0", "--flexdemo.no_outer_nesterov",
                    "--flexdemo.replica_check_interval", "5"],
}
STEP_LINE = re.compile(r"replica check at step (\d+): (\d+) replicas identical \(local (?:param|global copy) digest (\w+)\)")
LOSS_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([\d.]+)")
LOADED_LINE = re.compile(r"Loading the checkpoint from \S*step-(\d+)")
HEALED_LINE = re.compile(r"elastic replica healed from a live peer at step (\d+)")


def start_replicas(folder: Path, flags: list[str], steps: int) -> Cluster:
    """Three replicas and their Lighthouse (at least 2 per step); logs under ``folder``."""
    # Start-up on a loaded machine is uneven: wait up to 10 s for every replica to join a quorum.
    cluster = Cluster(folder, 2, env={"OMP_NUM_THREADS": "1"}, lighthouse_env={"JOIN_TIMEOUT_MS": "10000"})
    for r in range(3):
        start_replica(cluster, r, f"replica{r}", flags, steps)
    return cluster


def start_replica(cluster: Cluster, replica: int, name: str, flags: list[str], steps: int) -> None:
    cluster.start(name, CONFIG, ["--fault_tolerance.replica_id", str(replica), "--training.steps", str(steps),
                                 "--job.dump_folder", str(cluster.folder / f"replica{replica}"),
                                 "--metrics.disable_color_printing", *flags])


def wait_for_checkpoint(cluster: Cluster, name: str, folder: Path, deadline: float) -> None:
    """Until ``folder`` holds a complete checkpoint (DCP writes its .metadata last)."""
    while not any((d / ".metadata").is_file() for d in folder.glob("step-*")):
        if cluster.procs[name].poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{name} wrote no checkpoint in {folder} before it ended or the deadline")
        time.sleep(0.2)


def parse(log: Path) -> tuple[dict[int, tuple[int, str]], dict[int, float]]:
    text = log_text(log)
    checks = {int(m.group(1)): (int(m.group(2)), m.group(3)) for m in STEP_LINE.finditer(text)}
    losses = {int(m.group(1)): float(m.group(2)) for m in LOSS_LINE.finditer(text)}
    return checks, losses


def run_mode(mode: str, out: Path, steps: int, kill_at: int, restart_at: int, timeout: float,
             baseline: bool = True) -> tuple[str, bool]:
    flags = MODE_FLAGS[mode]
    base, base_codes = None, {}
    if baseline:
        base = start_replicas(out / mode / "uninterrupted", flags, steps)
        try:
            base_codes = base.wait_all(time.time() + timeout)
        finally:
            base.close()
    run = start_replicas(out / mode / "outage", flags, steps)
    try:
        deadline = time.time() + timeout
        run.wait_for_step("replica2", kill_at, deadline)
        # A replica that joined late (healed at start from a peer ahead of it) may not have written
        # a checkpoint yet: the kill waits for its first one, which the restart is to load.
        wait_for_checkpoint(run, "replica2", run.folder / "replica2" / "checkpoint", deadline)
        run.kill("replica2")
        killed = last_logged_step(run.log("replica0"))
        run.wait_for_step("replica0", restart_at, deadline)
        start_replica(run, 2, "replica2_restarted", flags, steps)
        codes = run.wait_all(deadline)
    finally:
        run.close()
    del codes["replica2"]  # killed on purpose
    ok = all(c == 0 for c in [*codes.values(), *base_codes.values()])
    r0, loss0 = parse(run.log("replica0"))
    back, _ = parse(run.log("replica2_restarted"))
    text = log_text(run.log("replica2_restarted"))
    loaded, healed = LOADED_LINE.search(text), HEALED_LINE.search(text)
    # the restarted replica resumes from the live peers, not from its own last checkpoint
    rejoined = bool(loaded and healed and int(healed.group(1)) > int(loaded.group(1)))
    print(f"elastic {mode}: replica 2 restarted, loaded its checkpoint of step "
          f"{loaded.group(1) if loaded else 'none'}, healed from a live peer at step "
          f"{healed.group(1) if healed else 'none'}", file=sys.stderr)
    base_final = f"{parse(base.log('replica0'))[1].get(steps, float('nan')):.4f}" if base else "not run"
    back_at = min(back, default=steps + 1)  # the restarted replica's first check
    outage = sum(1 for s in loss0 if killed < s < back_at)
    equal = bool(back) and min(back) > killed and all(r0.get(s, (0, None))[1] == d for s, (_, d) in back.items())
    final = loss0.get(steps, float("nan"))
    line = (f"elastic {mode}: survivors took {outage} steps during the outage; rejoined replica bitwise equal: "
            f"{'yes' if equal else 'no'}; final loss {final:.4f} (uninterrupted {base_final})")
    if not ok:
        line += f"  [exit codes: uninterrupted {base_codes}, outage {codes}; logs in {out / mode}]"
    return line, ok and equal and outage > 0 and rejoined


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="demo,demo_diloco", help=f"comma-separated, of: {', '.join(MODE_FLAGS)}")
    ap.add_argument("--out", default=str(REPO / "outputs" / "elastic_demo"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kill-at", type=int, default=15)
    ap.add_argument("--restart-at", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="skip the uninterrupted runs (only the final loss compares with them)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODE_FLAGS]
    if unknown:
        ap.error(f"modes {unknown} do not run elastic replicas yet; these do: {', '.join(MODE_FLAGS)}")
    lines, good = [], True
    for mode in modes:
        line, ok = run_mode(mode, Path(args.out), args.steps, args.kill_at, args.restart_at, args.timeout,
                            args.baseline)
        lines.append(line)
        good &= ok
    print("\n".join(lines))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
