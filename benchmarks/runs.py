"""Run training variants side by side (one scripts/launch.sh job each, sharing this machine's
devices) and tabulate their held-out validation losses: the convergence-recipe sweep.

  python3 benchmarks/runs.py --out outputs/recipe --concurrent 2 --timeout 300 \
      --common "--model.flavor small --training.steps 1000 --validation.freq 100" \
      "dd_top256_decay1 gpu_2gpu_demo_diloco --flexdemo.outer_topk 256 --flexdemo.outer_decay 1.0" \
      "adamw_lr3e-3 gpu_2gpu_ddp_adamw --optimizer.lr 3e-3"

Each variant is "NAME CONFIG [torchtitan flags...]" (CONFIG: a file in train_configs/, without
.toml).  Jobs that share devices run slower, so compare their losses, not their speed; with
--devices-per-job N each job gets N GPUs of its own (CUDA_VISIBLE_DEVICES), e.g. two 2-GPU jobs
on a 4-GPU machine, and its tokens/s stand on their own; with --shared-gpu all of a job's
ranks share one GPU (benchmarks/shared_gpu.py), for losses where fewer GPUs are lent.  Logs
go to OUT/NAME.log as they are written; OUT/variants.md gets the table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from ports import free_port  # noqa: E402
from process_tree import kill_tree  # noqa: E402
from summarize_logs import validation_table  # noqa: E402
from titan_logs import parse  # noqa: E402


def device_slots(per_job: int) -> list[str]:
    """The visible GPUs in disjoint groups of ``per_job``, as CUDA_VISIBLE_DEVICES strings."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    elif shutil.which("nvidia-smi"):
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        ids = [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]
    else:
        ids = []  # no GPU: the caller's check says so
    return [",".join(ids[i:i + per_job]) for i in range(0, len(ids) - per_job + 1, per_job)]


def run_all(todo: list, running: list, args: argparse.Namespace, out: Path, slots: list[str]) -> None:
    """Start the jobs ``args.concurrent`` at a time; each gets ``args.timeout`` seconds."""
    while todo or running:
        while todo and len(running) < args.concurrent:
            name, cfg, flags = todo.pop(0)
            env = {**os.environ, "MASTER_PORT": str(free_port()), "LOG_RANK": "0"}
            if args.nproc:
                env["NPROC"] = args.nproc
            slot = None
            if slots:  # the least-loaded slot; run_all never starts more than slots x jobs_per_slot
                busy = [r[3] for r in running]
                slot = min(slots, key=busy.count)
                env["CUDA_VISIBLE_DEVICES"] = slot
            start = [sys.executable, str(REPO / "benchmarks" / "shared_gpu.py")] if args.shared_gpu else \
                ["bash", str(REPO / "scripts" / "launch.sh")]
            cmd = [*start, str(cfg), *flags, "--job.dump_folder", f"/tmp/variants/{name}",
                   "--metrics.disable_color_printing"]
            (out / f"{name}.cmd").write_text(shlex.join(cmd) + "\n")
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out / f"{name}.log", "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
            running.append((name, p, time.time(), slot))
        time.sleep(2)
        for item in list(running):
            name, p, start, _ = item
            if p.poll() is None and time.time() - start > args.timeout:
                kill_tree(p.pid)  # torchrun's workers sit in sessions of their own
                p.wait()
                print(f"=== {name}: killed after {args.timeout:.0f} s", flush=True)
            if p.poll() is not None:
                running.remove(item)
                print(f"=== {name}: exit {p.returncode}, {time.time() - start:.0f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--common", default="", help="flags for every variant")
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    ap.add_argument("--nproc", default=None, help="processes per job (default: launch.sh's)")
    ap.add_argument("--devices-per-job", type=int, default=0,
                    help="give each job this many GPUs of its own (0: every job sees every GPU)")
    ap.add_argument("--jobs-per-slot", type=int, default=1,
                    help="with --devices-per-job: jobs that may share one group of GPUs (small models "
                         "leave a GPU mostly idle; losses stay comparable, tokens/s do not)")
    ap.add_argument("--shared-gpu", action="store_true",
                    help="every job's ranks on one GPU over gloo (benchmarks/shared_gpu.py): losses "
                         "compare, tokens/s do not")
    args = ap.parse_args()
    slots = device_slots(args.devices_per_job) if args.devices_per_job else []
    if args.devices_per_job and args.concurrent > len(slots) * args.jobs_per_slot:
        ap.error(f"--concurrent {args.concurrent} needs {args.concurrent * args.devices_per_job} GPUs "
                 f"(or more --jobs-per-slot); {len(slots) * args.devices_per_job} visible")
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    # variants.md marks a finished batch (watch_runs.py stops on it): an earlier batch's must not
    (out / "variants.md").unlink(missing_ok=True)
    todo = []
    for spec in args.variants:
        name, config, *flags = shlex.split(spec)
        cfg = REPO / "train_configs" / f"{config}.toml"
        if not cfg.is_file():
            ap.error(f"variant {name}: no {cfg}")
        todo.append((name, cfg, [*shlex.split(args.common), *flags]))
    running: list[tuple[str, subprocess.Popen, float, str | None]] = []
    # A timeout's SIGTERM (gpu_link_and_recipe.sh's cap on the whole sweep) must still stop the
    # jobs, workers included: the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run_all(todo, running, args, out, slots)
    finally:
        for name, p, _, _ in running:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait()
                print(f"=== {name}: stopped (run_variants.py ended)", flush=True)
    rows = [parse(out / f"{shlex.split(s)[0]}.log") for s in args.variants]
    table = validation_table(rows)
    (out / "variants.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
