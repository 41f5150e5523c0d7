"""Summarize torchtitan logs of flexdemo / baseline runs as a markdown table.

  python scripts/summarize_titan_logs.py outputs/titan_bench/*.log

Per log (rank 0's lines): final loss, mean tokens/s per GPU over the logged steps after the
first (compile and warm-up), the last validation loss, torchtitan's peak memory, bytes each rank sends and receives over
the replica dimension at the last logged step and received in total (flexdemo's measured
counter, or the baseline's modelled all-reduce bytes) and the exchange time.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_logs import mean_tokens_per_s, parse  # noqa: E402


def summarize(path: Path) -> dict:
    run = parse(path)
    if not run.loss:
        return {"run": run.name, "error": "no step lines"}
    last = max(run.loss)
    out = {"run": run.name, "steps": last, "final_loss": run.loss[last],
           "tokens_per_s_per_gpu": mean_tokens_per_s(run),
           "peak_memory_gib": max(run.memory_gib.values())}
    if run.validation:
        out["validation_loss"] = run.validation[max(run.validation)]
    if run.exchange:
        x = run.exchange[max(run.exchange)]
        out.update(bytes_sent_per_step=x.sent, bytes_received_per_step=x.received,
                   bytes_received_total=x.received_total, optimizer_step_ms=x.optimizer_step_ms,
                   exchange_ms=x.exchange_ms, bytes_modelled=run.bytes_modelled)
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
