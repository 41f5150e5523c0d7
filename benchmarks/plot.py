"""Loss against tokens, bytes over the replica dimension and wall time, one line per run, as
PNGs (matplotlib), from torchtitan + flexdemo logs (rank 0's console) or from the compact per-run
CSV summaries kept in docs/results/ (written from such logs by --extract).

  python3 benchmarks/plot.py --out outputs/plots outputs/runs/{adamw,flexdemo,diloco}.log
  python3 benchmarks/plot.py --extract outputs/runs/runs.csv outputs/runs/*.log [NAME=LOG ...]
  python3 benchmarks/plot.py --extract docs/results/FOLDER/runs.csv --append [--replace] NAME=LOG ...
  python3 benchmarks/plot.py --csv docs/results/1b_convergence/runs.csv --runs adamw,flexdemo --out DIR
  python3 benchmarks/plot.py --shaped docs/results/link_small_1gbit --out docs/plots/link_small_1gbit
  python3 benchmarks/plot.py --frontier docs/results/recipe_small/runs.csv --out docs/plots/recipe_small
  python3 benchmarks/plot.py --frontier CSV --same-bits k8_ef_s1234=k8_s1234:BYTES --out DIR

--frontier draws one point per run of a CSV (its last held-out loss against the bytes it received
in total, log scale) and prints the same as a markdown table, each run's loss and bytes set
against the baseline run (--baseline, default "adamw") of its seed (runs named NAME_sSEED, as
benchmarks/recipe.sh names them) and its bytes against B, a bf16 ring all-reduce every step
(half a baseline run's modelled fp32 counter; without one, against the baseline's own bytes).
--same-bits adds a point for a run whose payload a lossless coding shrinks (Elias-Fano indices
train bit for bit as fixed ones): that run's loss at the bytes counted with the coding.

Validation losses (torchtitan's validator: the same held-out tokens for every method) are the
lines; where a run has none, its training-batch losses are plotted instead, labelled so.  Bytes
are those each rank received over the replica dimension (flexdemo's counter; AdamW's modelled
ring all-reduce, labelled).  With --shaped (a benchmarks/shaped_link.py folder: its results.json
and either its logs or their runs.csv), the time axis is shaped_link.py's (its latency model
added; a method's time extrapolated where it ran few steps on the link), said in the labels.

The CSV has one row per logged step of each run: run, step, tokens (all replicas), loss (training
batch), val_loss, seconds / val_seconds (after step 1's log line), tokens_per_s (per GPU, as
torchtitan logs it), bytes_sent (this step, per rank), bytes_received_total (per rank, so far) and
bytes_modelled (1: AdamW's all-reduce bytes are modelled from its gradient size, not counted).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from titan_logs import Exchange, RunLog, parse  # noqa: E402


@dataclass
class Series:
    label: str
    step: list[int]
    loss: list[float]
    tokens: list[float]
    bytes: list[float | None]
    seconds: list[float | None]


# corpus_sha256 / heldout_digest / card: what the run read and ran on; steps_planned: its training.steps
# (a run that stopped before them has no final). Its first row only; empty where its log does not say.
FIELDS = ("run", "step", "tokens", "loss", "val_loss", "seconds", "val_seconds", "tokens_per_s",
          "bytes_sent", "bytes_received_total", "bytes_modelled", "corpus_sha256", "heldout_digest", "card",
          "steps_planned")


def _cell(x, fmt: str = "") -> str:
    return "" if x is None else format(x, fmt)


def csv_rows(run: RunLog) -> list[dict]:
    """One row per step that ``run`` logged anything at (training loss, validation, exchange)."""
    rows = []
    for s in sorted({*run.loss, *run.validation, *run.exchange}):
        x = run.exchange.get(s)
        rows.append({"run": run.name, "step": s,
                     "tokens": _cell(s * run.tokens_per_step if run.tokens_per_step else None),
                     "loss": _cell(run.loss.get(s), ".4f"), "val_loss": _cell(run.validation.get(s), ".4f"),
                     "seconds": _cell(run.step_time.get(s), ".2f"),
                     "val_seconds": _cell(run.validation_time.get(s), ".2f"),
                     "tokens_per_s": _cell(run.tps.get(s), ".0f"), "bytes_sent": _cell(x and x.sent),
                     "bytes_received_total": _cell(x and x.received_total),
                     "bytes_modelled": int(run.bytes_modelled), "corpus_sha256": "", "heldout_digest": "", "card": "",
                     "steps_planned": ""})
    if rows:
        rows[0].update(corpus_sha256=run.corpus_sha256, heldout_digest=run.heldout_digest, card=run.card,
                       steps_planned=_cell(run.steps_planned))
    return rows


def write_csv(path: Path, runs: list[RunLog]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, lineterminator="\n")
        w.writeheader()
        for run in runs:
            w.writerows(csv_rows(run))


def append_csv(path: Path, runs: list[RunLog], replace: bool = False) -> None:
    """Add the runs' rows to a CSV written by write_csv (a batch of a comparison run in another
    session). A run already there is refused, or with ``replace`` its old rows dropped first (a rerun
    of a killed run): a run's rows twice would leave which of them is the run unknown."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        old = list(reader)
    if tuple(reader.fieldnames or ()) != FIELDS:
        raise ValueError(f"{path} has columns {reader.fieldnames}, not plot.py's {list(FIELDS)}")
    names = [run.name for run in runs]
    if len(set(names)) < len(names):
        raise ValueError(f"a run named twice among the logs: {names}")
    there = sorted(set(names) & {row["run"] for row in old})
    if there and not replace:
        raise ValueError(f"runs already in {path}: {there} (--replace drops their rows first)")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(row for row in old if row["run"] not in names)
        for run in runs:
            w.writerows(csv_rows(run))


def read_csv(path: Path) -> dict[str, RunLog]:
    """The runs of a CSV written by write_csv, as RunLogs (in file order) that series() and
    titan_logs' helpers read as they read a parsed log: losses, times, tokens/s, bytes."""
    runs: dict[str, RunLog] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            run = runs.setdefault(row["run"], RunLog(row["run"]))
            s = int(row["step"])
            if row["tokens"] and run.tokens_per_step is None:
                run.tokens_per_step = int(row["tokens"]) // s
            for attr, key in (("loss", "loss"), ("validation", "val_loss"), ("step_time", "seconds"),
                              ("validation_time", "val_seconds"), ("tps", "tokens_per_s")):
                if row[key]:
                    getattr(run, attr)[s] = float(row[key])
            if row["bytes_received_total"]:
                run.exchange[s] = Exchange(int(row["bytes_sent"] or 0), 0, int(row["bytes_received_total"]),
                                           math.nan, None)
            run.bytes_modelled = run.bytes_modelled or row["bytes_modelled"] == "1"
            run.corpus_sha256 = run.corpus_sha256 or row.get("corpus_sha256") or ""  # (CSVs before the column)
            run.heldout_digest = run.heldout_digest or row.get("heldout_digest") or ""
            run.card = run.card or row.get("card") or ""
            if row.get("steps_planned"):
                run.steps_planned = int(row["steps_planned"])
    return runs


def _at(table: dict[int, float], step: int) -> float | None:
    """The value at ``step``, or at the last step logged before it (totals only grow)."""
    before = [s for s in table if s <= step]
    return table[max(before)] if before else None


def _totals(run: RunLog, steps: list[int]) -> dict[int, int]:
    """Bytes received per rank up to each step, read after that step's exchange: the logs' last
    byte line can come before the last step (every 10th step logged: 1020 of 1024), and a DiLoCo
    mode's last outer step is the run's last step. A per-step mode (bytes sent every step) adds its
    per-step bytes for the steps after the last byte line; a DiLoCo mode (nothing sent per step;
    its name holds ``h<H>``) adds one sync's bytes per outer step after it."""
    totals = {s: x.received_total for s, x in run.exchange.items()}
    if not totals:
        return {}
    last = max(totals)
    out = {s: _at(totals, s) for s in steps}
    per_step = run.exchange[last].sent
    h = re.search(r"(?:^|_)h(\d+)(?:_|$)", run.name)
    for s in steps:
        if s <= last:
            continue
        if per_step:
            out[s] = totals[last] + (s - last) * (totals[last] // last)
        elif h and totals[last]:
            H = int(h[1])
            done = last // H
            out[s] = totals[last] // done * (s // H) if done else totals[last]
    return out


def series(run: RunLog, label: str | None = None, seconds: dict[int, float] | None = None) -> Series:
    kind = run.validation if run.validation else run.loss
    label = label or run.name
    if not run.validation:
        label += " (training batches)"
    if run.bytes_modelled:
        label += " [bytes modelled]"
    steps = sorted(kind)
    times = seconds if seconds is not None else {**run.step_time, **run.validation_time}
    totals = _totals(run, steps)
    return Series(label, steps, [kind[s] for s in steps], [s * (run.tokens_per_step or 0) for s in steps],
                  [totals.get(s) for s in steps], [times.get(s) for s in steps])


def _zoom(ax, values: list[float], targets: list[float], finals: list[float]) -> None:
    """y from just below the lowest loss to 12% above the highest target (and above every run's
    last value): where gaps of a few percent sit; the early, high part of the curves is cut off."""
    if not values:
        return
    lo = min(values)
    hi = max([t * 1.12 for t in targets] + [f * 1.03 for f in finals] + [lo * 1.05])
    ax.set_ylim(lo - 0.03 * (hi - lo), hi)


def plot(all_series: list[Series], out_dir: Path, title: str = "",
         targets: list[tuple[str, float]] = (), ring_bytes: float | None = None) -> list[Path]:
    """Held-out loss vs tokens, bytes and wall time. ``targets``: (label, loss) drawn as dashed
    horizontal lines (AdamW-DDP's final held-out loss); ``ring_bytes``: the byte baseline's whole
    run (a bf16 ring all-reduce every step), a dotted vertical line on the bytes plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    last_values = [s.loss[-1] for s in all_series if s.loss]
    for attr, xlabel, log_x, name in (("tokens", "tokens (all replicas)", False, "loss_vs_tokens.png"),
                                      ("bytes", "bytes received per rank over the replica dimension "
                                                "(read after the last step's exchange)", True,
                                       "loss_vs_bytes.png"),
                                      ("seconds", "wall time since step 1 (s)", True, "loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(11, 5))
        shown = []
        for s in all_series:
            pts = [(x, y) for x, y in zip(getattr(s, attr), s.loss) if x is not None and (x > 0 or not log_x)]
            if pts:
                ax.plot(*zip(*pts), marker="o", markersize=3, label=s.label)
                shown += [y for _, y in pts]
        for i, (label, loss) in enumerate(targets):
            ax.axhline(loss, ls="--", lw=1.2, color="black" if i == 0 else "dimgray",
                       label=f"target: {label} = {loss:.4f}")
        if attr == "bytes" and ring_bytes:
            ax.axvline(ring_bytes, ls=":", lw=1.2, color="black",
                       label=f"bf16 ring all-reduce every step, whole run ({ring_bytes:.3g} B)")
        if log_x:
            ax.set_xscale("log")
        _zoom(ax, shown, [t for _, t in targets], last_values)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (held-out validation unless labelled)")
        ax.set_title(title + "\n(y zoomed: the early part of the curves lies above the axis)", fontsize=9)
        written.append(_save(fig, ax, out_dir, name))
    return written


def _seed(name: str) -> str:
    return name.rsplit("_s", 1)[1] if "_s" in name else ""


CODES = [  # run-name codes of benchmarks/recipe.sh, spelled out in the frontier's legend
    (r"^dd_h(\d+)_k(\d+)", r"demo_diloco H=\1 outer top-\2"), (r"^k(\d+)", r"top-\1"),
    (r"^top(\d+)", r"per-step top-\1"), (r"^demo_diloco_h(\d+)", r"demo_diloco H=\1"),
    (r"^sparseloco", "SparseLoCo preset"),
    (r"_olr([\d.]+?)(?=_|$)", r", outer lr \1"), (r"_h(\d+)_top(\d+)", r", H=\1 top-\2"),
    (r"_top(\d+)", r", top-\1"),
    (r"_1b\b", ""), (r"_d9995\b", ", decay 0.9995"), (r"_d995\b", ", decay 0.995"),
    (r"_lr5e-4\b", ", lr 5e-4"), (r"_two_bit\b", ", two_bit values"), (r"_scaled\b", ", scaled_sign values"),
    (r"_ef\b", ", elias_fano indices"), (r"_s\b", ", lr 5e-4"), (r"_l\b", ", lr 2e-3")]


def describe(name: str) -> str:
    """recipe.sh's code (k8_d995_s1234) in words (top-8, decay 0.995), without the seed."""
    base = re.sub(r"_s\d+$", "", name)
    for pat, rep in CODES:
        base = re.sub(pat, rep, base)
    return base


def frontier(runs: dict[str, RunLog], out_dir: Path, baseline: str, title: str = "",
             same_bits: tuple[tuple[str, str, int], ...] = ()) -> tuple[Path, str]:
    """Last held-out loss vs total bytes per run (a PNG), and the markdown table of the same.
    One marker shape and colour per setting (its code spelled out in the legend), filled for the
    first seed and hollow for the others; the baseline's final loss per seed is the target line.
    ``same_bits``: (NAME, RUN, BYTES) points for a run sent with a lossless coding (Elias-Fano
    indices: the same training bit for bit), RUN's loss at BYTES, named NAME in the table as such."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {}
    for name, run in runs.items():
        last = max(run.validation)
        totals = _totals(run, [last])
        points[name] = (run.validation[last], totals.get(last), last)
    for name, run, nbytes in same_bits:
        points[name] = (points[run][0], nbytes, points[run][2])
    recoded = {name: run for name, run, _ in same_bits}
    is_base = {n for n in points if n.split("_")[0] == baseline}
    # the target of a seed is the run named exactly BASELINE_sSEED; variants (adamw_lr5e-4_s1234)
    # are drawn as their own lines, never silently taken as the target
    target_of = {}
    for n in sorted(is_base, key=lambda n: (n != f"{baseline}_s{_seed(n)}", n)):
        target_of.setdefault(_seed(n), n)
    base = {seed: points[n] for seed, n in target_of.items()}
    # the one byte baseline B: a bf16 ring all-reduce every step (from a baseline run's modelled counter)
    ring = ring_bytes([runs[n] for n in sorted(is_base)])
    lines = [f"| run | held-out loss @{max(p[2] for p in points.values())} | vs {baseline} (same seed) "
             f"| bytes received per rank | {'B' if ring else baseline + chr(39) + 's bytes'} / it |",
             "|---|---:|---:|---:|---:|"]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    seeds = sorted({_seed(n) for n in points})
    settings = sorted({describe(n) for n in points if n not in is_base},
                      key=lambda d: min(points[n][1] or 0 for n in points if describe(n) == d))
    # colour: the family (top-k, or the demo_diloco setting); marker: the variant within it
    families = sorted({d.split(",")[0] for d in settings})
    variants = sorted({d.partition(",")[2] for d in settings})
    ncolors = 10 if len(families) <= 10 else 20  # tab10 repeats its colours past 10 families
    cmap = plt.get_cmap(f"tab{ncolors}")
    markers = "osD^vP*Xh<>p"
    style = {d: (cmap(families.index(d.split(",")[0]) % ncolors), markers[variants.index(d.partition(",")[2]) % 12])
             for d in settings}
    drawn = set()
    above = []
    for name, (loss, nbytes, _) in points.items():
        ref = base.get(_seed(name))
        rel = f"{100 * (loss / ref[0] - 1):+.1f}%" if ref else "-"
        over = ring if ring else (ref[1] if ref else None)
        ratio = "-" if not (over and nbytes) else f"{over / nbytes:,.0f}x" if over >= 10 * nbytes else \
            f"{over / nbytes:.1f}x"
        shown = f"{name} (the bits of {recoded[name]})" if name in recoded else name
        lines.append(f"| {shown} | {loss:.4f} | {rel} | {nbytes:,.0f} | {ratio} |")
        if name in is_base:
            target = target_of[_seed(name)] == name  # the line the table's percentages are against
            ax.axhline(loss, ls="--" if target else (0, (1, 3)), lw=1.2,
                       color="black" if _seed(name) == seeds[0] else "dimgray",
                       label=f"{'target: ' if target else ''}{describe(name)} final held-out loss, seed "
                             f"{_seed(name)} ({loss:.4f})")
        elif nbytes:
            d = describe(name)
            color, marker = style[d]
            first = _seed(name) == seeds[0]
            ax.scatter([nbytes], [loss], s=40, marker=marker, edgecolors=color, linewidths=1.3,
                       facecolors=color if first else "none", label=None if d in drawn else d, zorder=3)
            drawn.add(d)
            above.append(loss)
    targets = [points[n][0] for n in is_base]
    if targets:
        # a few percent above the target; runs up to 30% above it stay in view
        hi = max(max(targets) * 1.12, max((x for x in above if x <= max(targets) * 1.3), default=0) * 1.02)
        cut = sum(1 for x in above if x > hi)
        ax.set_ylim(min(above + targets) - 0.02, hi)
        if cut:
            ax.text(0.01, 0.98, f"{cut} run(s) above the axis", transform=ax.transAxes, fontsize=7, va="top")
    if ring:  # the targets' byte levels: 1,000x and 2,000x fewer than B
        for times, ls in ((1000, ":"), (2000, "-.")):
            ax.axvline(ring / times, ls=ls, lw=1, color="gray", label=f"B / {times:,} (B: bf16 ring, {ring:,.0f})")
    ax.set_xscale("log")
    ax.set_xlabel("bytes received per rank over the replica dimension, whole run (log)")
    ax.set_ylabel("last held-out loss")
    ax.set_title((title or "final held-out loss vs bytes") +
                 f"\nfilled: seed {seeds[0]}, hollow: seed{'s' * (len(seeds) > 2)} "
                 f"{', '.join(map(str, seeds[1:]))}; dashed: {baseline} per seed", fontsize=9)
    return _save(fig, ax, out_dir, "loss_vs_bytes_final.png"), "\n".join(lines)


def _save(fig, ax, out_dir: Path, name: str) -> Path:
    """A grid, the legend right of the axes, and the figure as OUT_DIR/NAME (closed)."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def interval_frontier(runs: dict[str, RunLog], out_dir: Path, baseline: str, seeds: list[str] | None = None,
                      title: str = "") -> tuple[Path, str]:
    """Per setting (runs NAME_sSEED), its final held-out loss against the baseline's on each seed as
    the mean and 95% interval over the paired seeds (benchmarks/paired_seeds.py) against its bytes
    (the mean over its seeds) against B: a PNG with error bars, 0 and +1% drawn, and the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from paired_seeds import last_losses, paired, table as paired_table, verdict
    from flexdemo.plan.intervals import paired_interval

    final = last_losses({n: r.validation for n, r in runs.items()}, {n: r.steps_planned for n, r in runs.items()})
    data = {n: (r.corpus_sha256, r.heldout_digest, r.card) for n, r in runs.items()}
    text = paired_table(final, baseline, seeds, data=data)  # refuses runs that read different data or cards
    _, settings = paired(final, baseline, seeds)
    ring = ring_bytes([r for n, r in runs.items() if n.rpartition("_s")[0] == baseline])
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
    for name, d in sorted(settings.items()):
        if len(d) < 2:
            continue  # one seed: no interval, no point
        iv = paired_interval([d[s] for s in sorted(d)])
        last = [(runs[f"{name}_s{s}"], max(runs[f"{name}_s{s}"].validation)) for s in d]
        nbytes = sum(_totals(run, [step])[step] for run, step in last) / len(last)
        x = ring / nbytes if ring else nbytes
        ax.errorbar([x], [100 * iv.mean], yerr=[[100 * iv.half_width], [100 * iv.half_width]], fmt="o", capsize=4,
                    label=f"{describe(name)} ({len(d)} seeds: {verdict(iv.low, iv.high)})")
    ax.axhline(0, color="black", lw=1.2, label=f"{baseline} (each seed's own)")
    ax.axhline(1, color="black", ls=":", lw=1, label="+1%")
    ax.set_xscale("log")
    ax.set_xlabel("fewer bytes than B, a bf16 ring all-reduce every step (log)" if ring else "bytes received per rank (log)")
    ax.set_ylabel(f"held-out loss vs {baseline}, % (95% interval)")
    ax.set_title(title or "loss against bytes, with intervals over paired seeds", fontsize=9)
    return _save(fig, ax, out_dir, "loss_vs_bytes_intervals.png"), text


def shaped_link_series(folder: Path) -> list[Series]:
    """The methods of a benchmarks/shaped_link.py folder, wall time with its latency model added
    (results.json): each validation's measured time + steps x collectives per step x RTT; a
    method that ran only a few steps on the link has its curve from its off-link reference run
    (METHOD_reference), its time extrapolated from the step time measured on the link.  The runs
    come from the folder's runs.csv where it has one, else from its logs (METHOD.log)."""
    res = json.loads((folder / "results.json").read_text())
    rtt = res["args"]["rtt_ms"] / 1000
    table = read_csv(folder / "runs.csv") if (folder / "runs.csv").is_file() else None

    def load(name: str) -> RunLog | None:
        if table is not None:
            return table.get(name)
        return parse(folder / f"{name}.log", name) if (folder / f"{name}.log").is_file() else None

    out = []
    for m, r in res["methods"].items():
        run = load(m)
        label = f"{m} (+{res['args']['rtt_ms']:g} ms RTT model)"
        if (ref := load(f"{m}_reference")) is not None:  # a few steps on the link, the curve off it
            run = ref
            run.name = m
            seconds = {s: s * r["seconds_per_step"] for s in run.validation}
            label = f"{m} (time: {r['steps']} steps measured on the link, extrapolated; + RTT model)"
        else:
            seconds = dict(run.validation_time)
        seconds = {s: t + s * r["collectives_per_step"] * rtt for s, t in seconds.items()}
        out.append(series(run, label, seconds))
    return out


def ring_bytes(runs: list[RunLog]) -> float | None:
    """The byte baseline over a whole run: a bf16 ring all-reduce every step, half of what an
    AdamW-DDP run's modelled fp32 counter moves per step, times its last step."""
    for run in runs:
        if run.bytes_modelled and run.exchange:
            first = min(run.exchange)
            per_step = run.exchange[first].received_total / first
            return per_step / 2 * max([*run.loss, *run.validation])
    return None


def _named_logs(specs: list[str]) -> list[RunLog]:
    """LOG or NAME=LOG (the run's name in the CSV; default the log's file name)."""
    out = []
    for spec in specs:
        name, eq, path = spec.partition("=")
        out.append(parse(path, name) if eq else parse(spec))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="*", help="console logs, LOG or NAME=LOG")
    ap.add_argument("--shaped", default=None, help="a benchmarks/shaped_link.py output folder instead of logs")
    ap.add_argument("--csv", default=None, help="a CSV written by --extract instead of logs")
    ap.add_argument("--runs", default="", help="with --csv: the runs to plot, comma-separated (default: all)")
    ap.add_argument("--extract", default=None, metavar="CSV",
                    help="write the logs' per-step summary to this CSV instead of plotting")
    ap.add_argument("--append", action="store_true",
                    help="with --extract: add the logs' rows to that existing CSV (a run already there is refused)")
    ap.add_argument("--replace", action="store_true",
                    help="with --append: a run already in the CSV has its old rows dropped first (a killed run rerun)")
    ap.add_argument("--frontier", default=None, metavar="CSV",
                    help="one point per run of this CSV: last held-out loss vs total bytes, and a table")
    ap.add_argument("--baseline", default="adamw", help="with --frontier: the baseline runs' name")
    ap.add_argument("--same-bits", action="append", default=[], metavar="NAME=RUN:BYTES",
                    help="with --frontier: a point for RUN sent with a lossless coding (Elias-Fano indices), "
                         "its loss at BYTES received per rank in the whole run, named NAME; repeatable")
    ap.add_argument("--intervals", action="store_true",
                    help="with --frontier: each setting's mean and 95%% interval over paired seeds against AdamW, "
                         "vs its bytes (loss_vs_bytes_intervals.png), and the table of benchmarks/paired_seeds.py")
    ap.add_argument("--seeds", nargs="*", default=None, help="with --intervals: only these seeds (the claim seeds)")
    ap.add_argument("--out", default="outputs/plots")
    ap.add_argument("--title", default="")
    ap.add_argument("--target-runs", default=None,
                    help="with --csv or logs: the runs whose final held-out loss is the target line, comma-separated "
                         "(default: those named adamw*); with --shaped the target is results.json's")
    args = ap.parse_args()
    if (args.append and not args.extract) or (args.replace and not args.append):
        ap.error("--append goes with --extract, --replace with --append")
    if args.frontier and args.intervals:
        try:
            path, table = interval_frontier(read_csv(Path(args.frontier)), Path(args.out), args.baseline, args.seeds,
                                            args.title)
        except ValueError as e:  # runs that end at different steps or read different data
            sys.exit(f"plot: {e}")
        print(table)
        print(path)
        return 0
    if args.frontier:
        runs = read_csv(Path(args.frontier))
        same_bits = []
        for spec in args.same_bits:
            name, _, rest = spec.partition("=")
            run, _, nbytes = rest.rpartition(":")
            if not (name and nbytes.isdigit()) or run not in runs or name in runs:
                ap.error(f"--same-bits {spec}: takes NAME=RUN:BYTES, RUN a run of {args.frontier}, NAME a new one")
            same_bits.append((name, run, int(nbytes)))
        path, table = frontier(runs, Path(args.out), args.baseline, args.title, tuple(same_bits))
        print(table)
        print(path)
        return 0
    if sum(map(bool, (args.logs, args.shaped, args.csv))) != 1:
        ap.error("give exactly one of: logs, --shaped FOLDER, --csv FILE")
    if args.extract:
        if not args.logs:
            ap.error("--extract takes logs")
        if args.append:
            try:
                append_csv(Path(args.extract), _named_logs(args.logs), args.replace)
            except (OSError, ValueError) as e:
                sys.exit(f"plot: {e}")
        else:
            write_csv(Path(args.extract), _named_logs(args.logs))
        print(args.extract)
        return 0
    targets: list[tuple[str, float]] = []
    if args.shaped:
        all_series = shaped_link_series(Path(args.shaped))
        res = json.loads((Path(args.shaped) / "results.json").read_text())
        targets = [("AdamW-DDP's final held-out loss", res["target"])]
        chosen: list[RunLog] = []
    else:
        if args.csv:
            table = read_csv(Path(args.csv))
            names = [n for n in args.runs.split(",") if n] or list(table)
        else:
            table = {r.name: r for r in _named_logs(args.logs)}
            names = list(table)
        missing = [n for n in names if n not in table]
        if missing:
            ap.error(f"no run {missing} in {args.csv}; it has {list(table)}")
        chosen = [table[n] for n in names]
        all_series = [series(r) for r in chosen]
        wanted = args.target_runs.split(",") if args.target_runs else [n for n in names if n.startswith("adamw")]
        for n in wanted:
            if n not in table:
                ap.error(f"--target-runs: no run {n}")
            if table[n].validation:
                last = max(table[n].validation)
                targets.append((f"{n} @{last}", table[n].validation[last]))
    paths = plot(all_series, Path(args.out), args.title, targets, ring_bytes(chosen))
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
