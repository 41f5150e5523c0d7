"""Loss against tokens, bytes over the replica dimension and wall time, one line per method, as
PNGs (matplotlib), from torchtitan + flexdemo logs (rank 0's console).

  python3 benchmarks/plot.py --out docs/plots/run outputs/run/{adamw,flexdemo,diloco}.log
  python3 benchmarks/plot.py --out docs/plots/shaped --shaped docs/results/shaped_link_2gpu_h100

Validation losses (torchtitan's validator: the same held-out tokens for every method) are the
lines; where a log has none, its training-batch losses are plotted instead, labelled so.  Bytes
are those each rank received over the replica dimension (flexdemo's counter; AdamW's modelled
ring all-reduce, labelled).  With --shaped, the time axis is benchmarks/shaped_link.py's (its
latency model added; AdamW's time extrapolated where it ran few steps on the link), said in the
labels.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_logs import RunLog, parse  # noqa: E402


@dataclass
class Series:
    label: str
    step: list[int]
    loss: list[float]
    tokens: list[float]
    bytes: list[float | None]
    seconds: list[float | None]


def _at(table: dict[int, float], step: int) -> float | None:
    """The value at ``step``, or at the last step logged before it (totals only grow)."""
    before = [s for s in table if s <= step]
    return table[max(before)] if before else None


def series(run: RunLog, label: str | None = None, seconds: dict[int, float] | None = None) -> Series:
    kind = run.validation if run.validation else run.loss
    label = label or run.name
    if not run.validation:
        label += " (training batches)"
    if run.bytes_modelled:
        label += " [bytes modelled]"
    steps = sorted(kind)
    times = seconds if seconds is not None else {**run.step_time, **run.validation_time}
    totals = {s: x.received_total for s, x in run.exchange.items()}
    return Series(label, steps, [kind[s] for s in steps], [s * (run.tokens_per_step or 0) for s in steps],
                  [_at(totals, s) for s in steps], [times.get(s) for s in steps])


def plot(all_series: list[Series], out_dir: Path, title: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for attr, xlabel, log_x, name in (("tokens", "tokens (all replicas)", False, "loss_vs_tokens.png"),
                                      ("bytes", "bytes received per rank over the replica dimension", True,
                                       "loss_vs_bytes.png"),
                                      ("seconds", "wall time since step 1 (s)", True, "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for s in all_series:
            pts = [(x, y) for x, y in zip(getattr(s, attr), s.loss) if x is not None and (x > 0 or not log_x)]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=s.label)
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (held-out validation unless labelled)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def shaped_link_series(folder: Path) -> list[Series]:
    """The methods of a benchmarks/shaped_link.py folder, wall time with its latency model added
    (results.json): each validation's measured time + steps x collectives per step x RTT; a
    method that ran only a few steps on the link has its curve from its off-link reference run
    (METHOD_reference.log), its time extrapolated from the step time measured on the link."""
    res = json.loads((folder / "results.json").read_text())
    rtt = res["args"]["rtt_ms"] / 1000
    out = []
    for m, r in res["methods"].items():
        run = parse(folder / f"{m}.log", m)
        label = f"{m} (+{res['args']['rtt_ms']:g} ms RTT model)"
        if (folder / f"{m}_reference.log").is_file():  # a few steps on the link, the curve off it
            run = parse(folder / f"{m}_reference.log", m)
            seconds = {s: s * r["seconds_per_step"] for s in run.validation}
            label = f"{m} (time: {r['steps']} steps measured on the link, extrapolated; + RTT model)"
        else:
            seconds = dict(run.validation_time)
        seconds = {s: t + s * r["collectives_per_step"] * rtt for s, t in seconds.items()}
        out.append(series(run, label, seconds))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="*")
    ap.add_argument("--shaped", default=None, help="a benchmarks/shaped_link.py output folder instead of logs")
    ap.add_argument("--out", default="docs/plots")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    if bool(args.logs) == bool(args.shaped):
        ap.error("give either logs or --shaped FOLDER")
    all_series = shaped_link_series(Path(args.shaped)) if args.shaped else [series(parse(p)) for p in args.logs]
    paths = plot(all_series, Path(args.out), args.title)
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
