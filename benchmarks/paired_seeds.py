"""Loss claims over paired seeds from a results folder's runs.csv (benchmarks/titan_logs.py's rows):
for every setting NAME with runs NAME_sSEED and a baseline run BASELINE_sSEED on the same seeds,
d_i = final held-out loss / the baseline's on seed i - 1, and the 95% interval
mean(d) +- t(0.975, n - 1) sd(d) / sqrt(n) (flexdemo.plan.intervals), as a Markdown table.

  python3 benchmarks/paired_seeds.py docs/results/FOLDER [FOLDER ...] [--baseline adamw] [--seeds 11 22 33 44]
      [--step N]

Several folders are read as one (a comparison whose batches were kept in separate folders); a run
name found in two is refused.

Runs that stopped before their training.steps (a run killed when a device session ended), or at
different steps, are refused unless --step names a validation step they all reached: a killed run's
last loss is not a final, even where every run of a batch was killed at once.
Runs paired must have read the same data: where runs.csv records what each read (the training
corpus's sha256 and the held-out windows' digest, from its log), runs that differ, or that do not
say beside runs that do, are refused (batches run in different device sessions build the corpus
anew on each machine). So are runs on different GPU models (the card torchtitan's log names): one
seed's AdamW run on an H100 and on an H200 read the same data and start bit-identical, then part by
0.4-0.9% of held-out loss by step 798 (results 11), as much as two seeds do.

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


def rows(runs_csv: Path | list[Path]) -> list[dict]:
    """The rows of one runs.csv, or of several read as one (a comparison whose batches sit in separate
    folders); a run in two, or a step of a run twice in one (a batch rerun appended beside its killed
    rows), is refused, since which of its rows is the run could not be told."""
    found_in: dict[str, Path] = {}
    out: list[dict] = []
    for source in [runs_csv] if isinstance(runs_csv, Path) else runs_csv:
        with open(source) as f:
            mine = list(csv.DictReader(f))
        seen: set[tuple[str, str]] = set()
        for row in mine:
            if (row["run"], row["step"]) in seen:
                raise ValueError(f"run {row['run']} has step {row['step']} twice in {source}: keep one run's rows")
            seen.add((row["run"], row["step"]))
        for run in {row["run"] for row in mine}:
            if run in found_in:
                raise ValueError(f"run {run} is in both {found_in[run]} and {source}")
            found_in[run] = source
        out += mine
    return out


def held_out(runs_csv: Path | list[Path]) -> dict[str, dict[int, float]]:
    """run -> {validation step: held-out loss}."""
    out: dict[str, dict[int, float]] = {}
    for row in rows(runs_csv):
        if row["val_loss"]:
            out.setdefault(row["run"], {})[int(row["step"])] = float(row["val_loss"])
    return out


def finals(runs_csv: Path | list[Path], step: int | None = None) -> dict[str, float]:
    """run -> its held-out loss at ``step`` (runs that never reached it left out), or else its last one;
    ValueError where the runs' last validation steps differ (a partial run's last loss is no final)."""
    series = held_out(runs_csv)
    if step is not None:
        return {run: losses[step] for run, losses in series.items() if step in losses}
    return last_losses(series, steps_planned(runs_csv))


def steps_planned(runs_csv: Path | list[Path]) -> dict[str, int]:
    """run -> the training.steps its log names (runs whose log, or CSV, does not say left out)."""
    return {row["run"]: int(row["steps_planned"]) for row in rows(runs_csv) if row.get("steps_planned")}


def data_read(runs_csv: Path | list[Path]) -> dict[str, tuple[str, str, str]]:
    """run -> (corpus sha256, held-out digest, card) as runs.csv records them; "" for what it does not."""
    out: dict[str, tuple[str, str, str]] = {}
    for row in rows(runs_csv):
        said = tuple(row.get(key) or "" for key in ("corpus_sha256", "heldout_digest", "card"))
        if any(said) or row["run"] not in out:
            out[row["run"]] = said
    return out


def _groups(runs: list[str], key) -> dict:
    groups: dict = {}
    for run in runs:
        groups.setdefault(key(run), []).append(run)
    return groups


NOT_SAID = ("", "", "")  # a run data_read has no row for


def check_same_data(data: dict[str, tuple[str, str, str]], runs: list[str]) -> None:
    """ValueError naming the groups where ``runs`` did not all read the same data, or ran on different
    cards (what a run does not record counts as a difference from one that does; runs none of which
    record it pass)."""
    read = _groups(runs, lambda run: data.get(run, NOT_SAID)[:2])
    if len(read) > 1:
        raise ValueError("runs read different data (corpus sha256 / held-out digest): " + "; ".join(
            f"{corpus or 'not logged'} / {heldout[:16] or 'not logged'}: {', '.join(sorted(names))}"
            for (corpus, heldout), names in sorted(read.items())))
    cards = _groups(runs, lambda run: data.get(run, NOT_SAID)[2])
    if len(cards) > 1:
        raise ValueError("runs ran on different cards, whose numerics part one seed's trajectories: " + "; ".join(
            f"{card or 'not logged'}: {', '.join(sorted(names))}" for card, names in sorted(cards.items())))


def last_losses(series: dict[str, dict[int, float]], planned: dict[str, int | None] | None = None
                ) -> dict[str, float]:
    """run -> its last held-out loss, where every run's last validation step is the same one and, where
    ``planned`` says (run -> its training.steps), the step it was to end at."""
    last = {run: max(losses) for run, losses in series.items() if losses}
    planned = planned or {}
    short = {run: (s, planned[run]) for run, s in last.items() if planned.get(run) and s < planned[run]}
    if short:
        raise ValueError("runs without a held-out loss at their last step, killed before it or with a validation.freq "
                         "that does not divide it (" +
                         ", ".join(f"{run} validated last at {s} of {end}" for run, (s, end) in sorted(short.items())) +
                         "): no final; compare them at a step they all reached (--step N)")
    if len(set(last.values())) > 1:
        raise ValueError("runs end at different validation steps (" +
                         ", ".join(f"{run} {s}" for run, s in sorted(last.items())) +
                         "): compare them at a step they all reached (--step N)")
    return {run: series[run][s] for run, s in last.items()}


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


def paired_runs(baseline: str, base: dict[str, float], settings: dict[str, dict[str, float]]) -> list[str]:
    """The runs ``paired`` put in the table: the baseline's and every setting's on its seeds."""
    return [f"{baseline}_s{seed}" for seed in base] + [f"{name}_s{seed}" for name, d in settings.items() for seed in d]


def table(final: dict[str, float], baseline: str, seeds: list[str] | None = None, step: int | None = None,
          data: dict[str, tuple[str, str, str]] | None = None) -> str:
    """The Markdown table; with ``data`` (run -> what it read, and on which card) the paired runs must
    have read the same data on the same card."""
    base, settings = paired(final, baseline, seeds)
    read = ""
    if data is not None:
        runs = paired_runs(baseline, base, settings)
        check_same_data(data, runs)
        corpus, heldout, card = data.get(runs[0], NOT_SAID)
        read = f", corpus {corpus}, held-out digest {heldout[:16]}" if heldout else ""
        read += f", on {card}" if card else ""
    spread = statistics.stdev(base.values()) / statistics.fmean(base.values()) if len(base) > 1 else float("nan")
    lines = [f"{baseline}: seeds {', '.join(sorted(base))}, {f'held-out at step {step}' if step else 'finals'} "
             f"{' / '.join(f'{base[s]:.4f}' for s in sorted(base))}, std / mean {spread:.2%}{read}", "",
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
    ap.add_argument("folders", nargs="+", metavar="folder")
    ap.add_argument("--baseline", default="adamw")
    ap.add_argument("--seeds", nargs="*", default=None, help="only these seeds (e.g. the claim seeds, not the tuning ones)")
    ap.add_argument("--step", type=int, default=None, help="the held-out loss at this validation step, not the last")
    args = ap.parse_args(argv)
    runs_csv = [Path(f) / "runs.csv" for f in args.folders]
    try:
        print(table(finals(runs_csv, args.step), args.baseline, args.seeds, args.step, data_read(runs_csv)))
    except ValueError as e:
        sys.exit(f"paired_seeds: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
