"""Run training variants side by side (one scripts/launch.sh job each, sharing this machine's
devices) and tabulate their held-out validation losses: the convergence-recipe sweep.

  python3 scripts/run_variants.py --out outputs/recipe --concurrent 2 --timeout 300 \
      --common "--model.flavor small --training.steps 1000 --validation.freq 100" \
      "dd_top256_decay1 gpu_2gpu_demo_diloco --flexdemo.outer_topk 256 --flexdemo.outer_decay 1.0" \
      "adamw_lr3e-3 gpu_2gpu_ddp_adamw --optimizer.lr 3e-3"

Each variant is "NAME CONFIG [torchtitan flags...]" (CONFIG: a file in train_configs/, without
.toml).  Jobs that share devices run slower, so compare their losses, not their speed.  Logs
go to OUT/NAME.log as they are written; OUT/variants.md gets the table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from titan_logs import parse  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--common", default="", help="flags for every variant")
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    ap.add_argument("--nproc", default=None, help="processes per job (default: launch.sh's)")
    args = ap.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    todo = []
    for spec in args.variants:
        name, config, *flags = shlex.split(spec)
        cfg = REPO / "train_configs" / f"{config}.toml"
        if not cfg.is_file():
            ap.error(f"variant {name}: no {cfg}")
        todo.append((name, cfg, [*shlex.split(args.common), *flags]))
    running: list[tuple[str, subprocess.Popen, float]] = []
    port = 29600
    while todo or running:
        while todo and len(running) < args.concurrent:
            name, cfg, flags = todo.pop(0)
            port += 7
            env = {**os.environ, "MASTER_PORT": str(port), "LOG_RANK": "0"}
            if args.nproc:
                env["NPROC"] = args.nproc
            cmd = ["bash", str(REPO / "scripts" / "launch.sh"), str(cfg), *flags,
                   "--job.dump_folder", f"/tmp/variants/{name}", "--metrics.disable_color_printing"]
            (out / f"{name}.cmd").write_text(shlex.join(cmd) + "\n")
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out / f"{name}.log", "w"),
                                 stderr=subprocess.STDOUT, start_new_session=True)
            running.append((name, p, time.time()))
        time.sleep(2)
        for item in list(running):
            name, p, start = item
            if p.poll() is None and time.time() - start > args.timeout:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                print(f"=== {name}: killed after {args.timeout:.0f} s", flush=True)
            if p.poll() is not None:
                running.remove(item)
                print(f"=== {name}: exit {p.returncode}, {time.time() - start:.0f} s", flush=True)
    rows = [parse(out / f"{shlex.split(s)[0]}.log") for s in args.variants]
    steps = sorted({s for r in rows for s in r.validation})
    lines = ["| variant | " + " | ".join(f"val @{s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
    for r in rows:
        lines.append(f"| {r.name} | " + " | ".join(f"{r.validation[s]:.4f}" if s in r.validation else "-"
                                                 for s in steps) + " |")
    table = "\n".join(lines) + "\n"
    (out / "variants.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
