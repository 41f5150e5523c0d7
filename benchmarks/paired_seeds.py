"""Loss claims over paired seeds from a results folder's runs.csv (benchmarks/titan_logs.py's rows):
for every setting NAME with runs NAME_sSEED and a baseline run BASELINE_sSEED on the same seeds,
d_i = final held-out loss / the baseline's on seed i - 1, and the 95% interval
mean(d) +- t(0.975, n - 1) sd(d) / sqrt(n) (flexdemo.plan.intervals), as a Markdown table.

  python3 benchmarks/paired_seeds.py docs/results/FOLDER [--baseline adamw] [--seeds 11 22 33 44]

A verdict column applies the results page's words: "at or below AdamW" only where the interval's
upper end is <= 0, "within +1%" where it is <= +1%, "above" where its lower end is > 0, else
"no difference measured". AdamW's own spread (std / mean of its finals) heads the table.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexdemo.plan.intervals import paired_interval  # noqa: E402


def finals(runs_csv: Path) -> dict[str, float]:
    """run -> its last held-out loss (rows are in step order)."""
    out = {}
    with open(runs_csv) as f:
        for row in csv.DictReader(f):
            if row["val_loss"]:
                out[row["run"]] = float(row["val_loss"])
    return out


def verdict(low: float, high: float) -> str:
    if high <= 0:
        return "at or below the baseline"
    if high <= 0.01:
        return "within +1%"
    if low > 0:
        return "above the baseline"
    return "no difference measured"


def paired(final: dict[str, float], baseline: str, seeds: list[str] | None = None
           ) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(the baseline's final loss per seed, {setting: {seed: d}}): every run NAME_sSEED on a seed the
    baseline has (and ``seeds`` lists), d = its loss / the baseline's on that seed - 1."""
    base = {run.rsplit("_s", 1)[1]: loss for run, loss in final.items() if run.rsplit("_s", 1)[0] == baseline}
    if seeds:
        base = {s: base[s] for s in seeds if s in base}
    if not base:
        raise ValueError(f"no {baseline}_sSEED runs")
    settings: dict[str, dict[str, float]] = {}
    for run, loss in final.items():
        name, _, seed = run.rpartition("_s")
        if name and name != baseline and seed in base:
            settings.setdefault(name, {})[seed] = loss / base[seed] - 1
    return base, settings


def table(final: dict[str, float], baseline: str, seeds: list[str] | None = None) -> str:
    base, settings = paired(final, baseline, seeds)
    spread = statistics.stdev(base.values()) / statistics.fmean(base.values()) if len(base) > 1 else float("nan")
    lines = [f"{baseline}: seeds {', '.join(sorted(base))}, finals "
             f"{' / '.join(f'{base[s]:.4f}' for s in sorted(base))}, std / mean {spread:.2%}", "",
             "| setting | seeds | d per seed | mean [95% interval] | verdict |", "|---|---|---|---|---|"]
    for name in sorted(settings):
        d = settings[name]
        iv = paired_interval([d[s] for s in sorted(d)])
        word = verdict(iv.low, iv.high) if iv.n > 1 else "one seed: no claim"
        lines.append(f"| {name} | {', '.join(sorted(d))} | {' / '.join(f'{d[s]:+.1%}' for s in sorted(d))} | "
                     f"{iv.text()} | {word} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--baseline", default="adamw")
    ap.add_argument("--seeds", nargs="*", default=None, help="only these seeds (e.g. the claim seeds, not the tuning ones)")
    args = ap.parse_args(argv)
    print(table(finals(Path(args.folder) / "runs.csv"), args.baseline, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
