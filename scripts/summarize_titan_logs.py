"""Summarize torchtitan logs of flexdemo / baseline runs as a markdown table.

  python scripts/summarize_titan_logs.py outputs/titan_bench/*.log

Per log (rank 0's lines): final loss, mean tokens/s per GPU over the logged steps after the
first (compile and warm-up), the last validation loss, torchtitan's peak memory, bytes each rank sends and receives over
the replica dimension at the last logged step and received in total (flexdemo's measured
counter, or the baseline's modelled all-reduce bytes) and the exchange time.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STEP = re.compile(r"\[rank0\].* - INFO - step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
VALID = re.compile(r"\[rank0\].*validate step:\s*(\d+)\s+loss:\s*(\S+)")
XCHG = re.compile(r"\[rank0\].*flexdemo step:\s*(\d+)\s+sent_bytes(?:_modelled)?:\s*(\d+)"
                  r"\s+received_bytes(?:_modelled)?:\s*(\d+)"
                  r"\s+sent_bytes_total(?:_modelled)?:\s*(\d+)\s+received_bytes_total(?:_modelled)?:\s*(\d+)"
                  r".*?optimizer_step_ms:\s*([\d.]+)(?:\s+exchange_ms:\s*([\d.]+))?")


def summarize(path: Path) -> dict:
    steps, xchg, valid, modelled = {}, {}, {}, False
    for raw in path.read_text(errors="replace").splitlines():
        line = ANSI.sub("", raw)
        if m := VALID.search(line):
            valid[int(m[1])] = float(m[2])
        elif m := STEP.search(line):
            steps[int(m[1])] = (float(m[2]), float(m[4].replace(",", "")), float(m[3]))
        elif m := XCHG.search(line):
            xchg[int(m[1])] = (int(m[2]), int(m[3]), int(m[5]), float(m[6]), float(m[7]) if m[7] else None)
            modelled = modelled or "modelled" in line
    if not steps:
        return {"run": path.stem, "error": "no step lines"}
    last = max(steps)
    tps = [t for s, (_, t, _) in steps.items() if s > 1]
    out = {"run": path.stem, "steps": last, "final_loss": steps[last][0],
           "tokens_per_s_per_gpu": sum(tps) / len(tps) if tps else float("nan"),
           "peak_memory_gib": max(mem for _, _, mem in steps.values())}
    if valid:
        out["validation_loss"] = valid[max(valid)]
    if xchg:
        s = xchg[max(xchg)]
        out.update(bytes_sent_per_step=s[0], bytes_received_per_step=s[1], bytes_received_total=s[2],
                   optimizer_step_ms=s[3], exchange_ms=s[4], bytes_modelled=modelled)
    return out


def main(paths):
    rows = [summarize(Path(p)) for p in paths]
    cols = ["run", "steps", "final_loss", "validation_loss", "tokens_per_s_per_gpu", "peak_memory_gib", "bytes_sent_per_step",
            "bytes_received_per_step", "bytes_received_total", "bytes_modelled", "optimizer_step_ms", "exchange_ms",
            "error"]
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:,.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
