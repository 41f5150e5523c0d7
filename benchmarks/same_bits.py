"""Do two revisions of flexdemo train the same bits? For a refactor that must move nothing.

Runs the CPU 2 x 2 configs (one per mode) at each revision, each from a git worktree whose own
flexdemo comes first on PYTHONPATH, and compares per mode: rank 0's logged losses and exchange
byte counters at every step, and the final parameters bit for bit (the model-only checkpoint
torchtitan writes at the last step). With ``--resume`` it also checks that a checkpoint written by REV_BEFORE loads: REV_BEFORE trains
the first half with a full checkpoint, REV_AFTER resumes it, and the resumed second half must
equal REV_AFTER's uninterrupted run. Prints one line per mode and exits 1 if any differs.

    python benchmarks/same_bits.py REV_BEFORE REV_AFTER [--steps 20] [--resume] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ports import free_port  # noqa: E402
from titan_logs import parse  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"off": "cpu_2x2_hsdp_adamw.toml", "demo": "cpu_2x2_flexdemo.toml",
           "diloco": "cpu_2x2_diloco.toml", "demo_diloco": "cpu_2x2_demo_diloco.toml"}


def worktree(rev: str, out: Path) -> Path:
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                            capture_output=True, text=True).stdout.strip()
    path = out / f"tree-{commit}"
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                       capture_output=True)
    return path


def train(tree: Path, mode: str, steps: int, dump: Path, resume: bool = False, interval: int | None = None):
    """(step -> loss, step -> (sent, received, received in all) bytes, final parameters) of one
    CPU 2 x 2 run; ``resume``: from the checkpoint in ``dump``; ``interval``: also a full
    checkpoint every that many steps (the last one holds the model only)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "NPROC": "4", "LOG_RANK": "0", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(free_port())}
    log = dump / "console.log"
    if not resume:
        shutil.rmtree(dump, ignore_errors=True)  # a checkpoint left there would be resumed
    dump.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", "scripts/launch.sh", f"train_configs/{CONFIGS[mode]}", "--job.dump_folder", str(dump),
           "--metrics.disable_color_printing", "--training.steps", str(steps), "--checkpoint.enable",
           "--checkpoint.interval", str(interval or steps), "--checkpoint.last_save_model_only"]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{tree.name} {mode}: launch failed (rc {rc}), see {log}")
    run = parse(log)
    final = dump / "final.pt"
    dcp_to_torch_save(dump / "checkpoint" / f"step-{steps}", final)
    params = torch.load(final, weights_only=True)
    return run.loss, {s: (x.sent, x.received, x.received_total) for s, x in run.exchange.items()}, params


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors whose bits differ (or that only one side has)."""
    differ = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if not torch.is_tensor(x):
            continue
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            differ.append(name)
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--resume", action="store_true", help="also resume REV_BEFORE's checkpoint with REV_AFTER")
    ap.add_argument("--out", type=Path, default=Path("outputs/same_bits"))
    args = ap.parse_args()
    trees = [worktree(rev, args.out) for rev in (args.before, args.after)]
    failed = False
    for mode in args.modes:
        (la, ba, pa), (lb, bb, pb) = (train(t, mode, args.steps, args.out / t.name / mode) for t in trees)
        differ = same_bits(pa, pb)
        ok = la == lb and ba == bb and not differ and len(la) == args.steps
        failed |= not ok
        print(f"mode={mode}: {'same' if ok else 'DIFFERENT'}: losses {'equal' if la == lb else 'differ'} "
              f"({len(la)} steps, last {la.get(args.steps)}), bytes {'equal' if ba == bb else 'differ'} "
              f"(received in all {bb[max(bb)][2] if bb else 0} by rank 0), "
              f"final parameters {'bit-identical' if not differ else 'differ: ' + ', '.join(differ[:3])} "
              f"({len(pb)} tensors)")
        if args.resume:
            # The same run (its lr schedule spans every step) checkpointed halfway by the older
            # revision; the newer resumes from there.
            half, dump = args.steps // 2, args.out / "resumed" / mode
            train(trees[0], mode, args.steps, dump, interval=half)
            shutil.rmtree(dump / "checkpoint" / f"step-{args.steps}")
            lr, _, pr = train(trees[1], mode, args.steps, dump, resume=True)
            tail = {s: v for s, v in lb.items() if s > half}
            ok = {s: v for s, v in lr.items() if s > half} == tail and not same_bits(pr, pb) and len(tail) > 0
            failed |= not ok
            print(f"mode={mode}: {args.before}'s checkpoint at step {half} resumed by {args.after}: "
                  f"{'same as uninterrupted' if ok else 'DIFFERENT from uninterrupted'} (losses of steps "
                  f"{half + 1}..{args.steps}, final parameters)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
