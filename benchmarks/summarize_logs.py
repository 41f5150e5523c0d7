"""Summarize torchtitan logs of flexdemo / baseline runs as a markdown table.

  python benchmarks/summarize_logs.py outputs/titan_bench/*.log
  python benchmarks/summarize_logs.py --validation --baseline adamw --fewer-bytes-than diloco LOG...

Per log (rank 0's lines): final loss, mean tokens/s per GPU over the logged steps after the
first (compile and warm-up), the last validation loss, torchtitan's peak memory, bytes each rank sends and receives over
the replica dimension at the last logged step and received in total (flexdemo's measured
counter, or the baseline's modelled all-reduce bytes) and the exchange time.

--validation: one row per run with its held-out loss at every validated step, bytes received in
total and mean tokens/s per GPU; --baseline NAME adds the held-out loss relative to that run's
at its last validated step (equal tokens), and each --fewer-bytes-than NAME how many times fewer bytes than that run's each run received.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_logs import last_exchange, mean_tokens_per_s, parse  # noqa: E402


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
    if (x := last_exchange(run)) is not None:
        out.update(bytes_sent_per_step=x.sent, bytes_received_per_step=x.received,
                   bytes_received_total=x.received_total, optimizer_step_ms=x.optimizer_step_ms,
                   exchange_ms=x.exchange_ms, bytes_modelled=run.bytes_modelled)
    return out


def _bytes_total(run) -> int | None:
    x = last_exchange(run)
    return x.received_total if x is not None else None


def validation_table(runs: list, baseline: str | None = None, fewer_bytes_than: tuple[str, ...] = ()) -> str:
    """Markdown: each run's held-out loss at every validated step, bytes it received over the
    replica dimension in total (measured, or modelled for the baselines), mean tokens/s per GPU,
    and optionally its final held-out loss against ``baseline``'s and its bytes against others'."""
    by_name = {r.name: r for r in runs}
    for ref in (baseline, *fewer_bytes_than):
        if ref is not None and ref not in by_name:
            raise SystemExit(f"no run named {ref!r} among {sorted(by_name)}")
    steps = sorted({s for r in runs for s in r.validation})
    extra = ["bytes received per rank, total", "tokens/s/GPU"]
    if baseline:
        extra.append(f"final loss vs {baseline}")
    extra += [f"x fewer bytes than {ref}" for ref in fewer_bytes_than]
    lines = ["| run | " + " | ".join([*(f"val @{s}" for s in steps), *extra]) + " |",
             "|---|" + "---|" * (len(steps) + len(extra))]
    # At equal tokens: the baseline's last validated step ("-" where a run lacks it).
    ref = by_name[baseline].validation if baseline else {}
    at = max(ref) if ref else None
    ref_totals = [_bytes_total(by_name[name]) for name in fewer_bytes_than]
    for r in runs:
        cells = [f"{r.validation[s]:.4f}" if s in r.validation else "-" for s in steps]
        total = _bytes_total(r)
        cells.append("-" if total is None else f"{total:,}" + (" (modelled)" if r.bytes_modelled else ""))
        cells.append(f"{mean_tokens_per_s(r):,.0f}")
        if baseline:
            cells.append(f"{100 * (r.validation[at] / ref[at] - 1):+.1f}%" if at in r.validation else "-")
        for ref_total in ref_totals:
            ratio = ref_total / total if total and ref_total else None
            cells.append("-" if ratio is None else f"{ratio:,.0f}" if ratio >= 100 else f"{ratio:.3g}")
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--validation", action="store_true", help="the held-out loss table")
    ap.add_argument("--baseline", help="--validation: final loss relative to this run (log name without .log)")
    ap.add_argument("--fewer-bytes-than", action="append", default=[], help="--validation: bytes ratio to this run")
    args = ap.parse_args(argv)
    if (args.baseline or args.fewer_bytes_than) and not args.validation:
        ap.error("--baseline / --fewer-bytes-than go with --validation")
    if args.validation:
        print(validation_table([parse(Path(p)) for p in args.logs], args.baseline, tuple(args.fewer_bytes_than)), end="")
        return
    rows = [summarize(Path(p)) for p in args.logs]
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
