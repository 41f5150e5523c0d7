"""Follow runs.py jobs started in the background (``bash benchmarks/gpu.sh detach runs ...``)
across device calls, each of which may last only minutes:

  python3 benchmarks/watch_runs.py DIR --seconds 540 --out OUT

Every minute, one line per job log in DIR (last step, loss, tokens/s, last held-out loss);
stops after --seconds or once runs.py has written DIR/variants.md (all jobs ended); then packs
DIR's logs and table into OUT/runs_logs.tgz (the few files a device call returns).
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_logs import parse  # noqa: E402


def progress(folder: Path) -> str:
    lines = []
    for log in sorted(folder.glob("*.log")):
        r = parse(log)
        last = max(r.loss, default=None)
        val = max(r.validation, default=None)
        tps = [r.tps[s] for s in sorted(r.tps)[-5:]]
        lines.append(f"{log.stem}: step {last} loss {r.loss.get(last)} tps {sum(tps) / max(len(tps), 1):.0f}"
                     f" held-out@{val} {r.validation.get(val)}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--seconds", type=float, default=540)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    folder, end = Path(args.dir), time.time() + args.seconds
    while time.time() < end and not (folder / "variants.md").exists():
        time.sleep(min(60, max(end - time.time(), 0)))
        print(time.strftime("%H:%M:%S"), "\n" + progress(folder), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "runs_logs.tgz", "w:gz") as tar:
        for f in sorted(folder.glob("*")):
            if f.suffix in (".log", ".md", ".cmd", ".txt"):
                tar.add(f, arcname=f.name)
    print("done" if (folder / "variants.md").exists() else "still running", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
