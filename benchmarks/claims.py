"""The comparison corpus's loss claims as the docs give them, generated from the committed runs
(docs/results/pysource2_frontier_h100, claim seeds only), so that no number in them is typed by hand:

- README's headline: per setting, each seed's final held-out loss against AdamW-DDP's on the same seed,
  the mean with its 95% interval over the paired seeds and the results page's verdict
  (benchmarks/paired_seeds.py), and the bytes each rank received against B, a bf16 ring all-reduce every
  step (half AdamW-DDP's modelled fp32 counter, as plot.py's frontier); AdamW's seed spread and its lr
  check; the runbook's settings with no runs yet, named as not measured.
- results 11's table: every seed's held-out loss at each validation step AdamW's runs share, AdamW's
  std / mean beside corpus version 1's (docs/results/long_small_shared_h200, its tuning seeds), and each
  setting's paired interval at every step.

  python3 benchmarks/claims.py          # print both blocks
  python3 benchmarks/claims.py --write  # replace them in README.md and docs/results.md, between their markers

tests/test_claims.py fails where the docs and this disagree, and where a measured setting names no
shipped preset with the values its runs ran with.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
from paired_seeds import check_same_data, last_losses, paired, verdict  # noqa: E402
from plot import _totals, read_csv, ring_bytes  # noqa: E402

from flexdemo.plan.intervals import paired_interval  # noqa: E402

FOLDER = REPO / "docs" / "results" / "pysource2_frontier_h100"
SEEDS = ("11", "22", "33", "44")  # no setting was tuned on them (1234 / 4321 / 5678 were)
BASELINE = "adamw"
# stock AdamW-DDP, the shipped config at small's best lr (the config's own 3e-4 is 1B's, which results 1 ran)
BASELINE_CONFIG = ("gpu_2gpu_ddp_adamw.toml", "--optimizer.lr 1e-3")
LR_CHECK = (("adamw_lr5e-4", "5e-4"), ("adamw", "1e-3"), ("adamw_lr2e-3", "2e-3"))  # AdamW's lr, seed 11
LR_CHECK_SEED = "11"
VERSION1 = (REPO / "docs" / "results" / "long_small_shared_h200", ("1234", "4321", "5678"))  # its AdamW spread
# marker name -> the file whose block --write replaces
BLOCKS = {"headline": REPO / "README.md", "per-step": REPO / "docs" / "results.md"}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


@dataclass(frozen=True)
class Setting:
    runs: str  # the runbook's run name before _sSEED
    what: str
    preset: str | None  # the shipped config with its values; a measured setting must have one
    short: str  # its name in results 11's rows


SETTINGS = (
    Setting("top16", "per-step `demo`, top-16", "gpu_2gpu_flexdemo_top16.toml", "top-16"),
    Setting("demo_diloco_h30", "`demo_diloco`, H = 30, top-256 scaled signs, outer lr 1.5",
            "gpu_2gpu_demo_diloco_h30.toml", "demo_diloco H = 30"),
    Setting("sparseloco_olr3", "SparseLoCo's recipe, H = 30, top-64, outer lr 3", "gpu_2gpu_sparseloco_outer_lr3.toml",
            "SparseLoCo"),
    Setting("sparseloco_olr3_h16_top32", "SparseLoCo's recipe at H = 16, top-32, outer lr 3",
            "gpu_2gpu_sparseloco_h16_top32.toml",
            "SparseLoCo H = 16 top-32"),
)


def _ratio(ring: float, nbytes: float) -> str:
    x = ring / nbytes
    return f"{x:,.0f}x fewer" if x >= 10 else f"{x:.2g}x"


def _paired(folder: Path):
    """(runs, finals, the baseline's finals per seed, {setting: {seed: d}}): the claim seeds' runs, which
    must have read the same data on the same card."""
    runs = read_csv(folder / "runs.csv")
    final = last_losses({n: r.validation for n, r in runs.items()}, {n: r.steps_planned for n, r in runs.items()})
    base, settings = paired(final, BASELINE, list(SEEDS))
    check_same_data({n: (r.corpus_sha256, r.heldout_digest, r.card) for n, r in runs.items()},
                    [f"{BASELINE}_s{s}" for s in base] + [f"{n}_s{s}" for n, d in settings.items() for s in d])
    return runs, final, base, settings


def headline(folder: Path = FOLDER) -> str:
    runs, final, base, settings = _paired(folder)
    adamw = [runs[f"{BASELINE}_s{s}"] for s in base]
    ring = ring_bytes(adamw)
    if ring is None:
        raise ValueError("no AdamW-DDP run with its modelled byte counter: no byte baseline")

    def received(name: str, seeds) -> float:
        last = [(runs[f"{name}_s{s}"], max(runs[f"{name}_s{s}"].validation)) for s in seeds]
        return sum(_totals(run, [step])[step] for run, step in last) / len(last)

    seeds = sorted(base)
    finals = " / ".join(f"{base[s]:.4f}" for s in seeds)
    spread = _spread(list(base.values()))
    lines = [f"| setting (shipped config) | vs AdamW-DDP, same seed: {' / '.join(seeds)} | mean [95% interval] "
             "| verdict | bytes received per rank vs B, a bf16 ring all-reduce |", "|---|---|---:|---|---:|",
             f"| AdamW-DDP, lr 1e-3, the baseline (`{' '.join(BASELINE_CONFIG)}`) | finals {finals} | seed spread, "
             f"std / mean: {spread:.2%} | - | {_ratio(ring, received(BASELINE, seeds))} (fp32 gradients) |"]
    missing = []
    for s in SETTINGS:
        d = settings.get(s.runs)
        if not d:
            missing.append(s.what)
            continue
        iv = paired_interval([d[seed] for seed in sorted(d)])
        claim = verdict(iv.low, iv.high) if iv.n > 1 else "one seed: no claim"
        preset = f" (`{s.preset}`)" if s.preset else ""
        per_seed = " / ".join(f"{d[seed]:+.1%}" if seed in d else "-" for seed in seeds)  # "-": no run on it
        lines.append(f"| {s.what}{preset} | {per_seed} | "
                     f"**{iv.text()}** | {claim} | {_ratio(ring, received(s.runs, sorted(d)))} |")
    lr = {label: final.get(f"{name}_s{LR_CHECK_SEED}") for name, label in LR_CHECK}
    ran = [f"{label} {loss:.4f}" for label, loss in lr.items() if loss is not None]
    not_run = [label for label, loss in lr.items() if loss is None]
    lines += ["", f"AdamW-DDP's lr at this length, seed {LR_CHECK_SEED}'s final: {', '.join(ran)}"
              + (f"; {' and '.join(not_run)} not yet run." if not_run else ".")]
    if missing:
        lines.append(f"Not yet measured on this corpus: {'; '.join(missing)}.")
    return "\n".join(lines)


def _spread(losses: list[float]) -> float:
    return statistics.stdev(losses) / statistics.fmean(losses)


def per_step(folder: Path = FOLDER, version1: tuple[Path, tuple[str, ...]] = VERSION1) -> str:
    runs, _, base, settings = _paired(folder)
    seeds = sorted(base)
    held = {name: runs[name].validation for name in runs}
    steps = sorted(set.intersection(*(set(held[f"{BASELINE}_s{s}"]) for s in seeds)) - {1})  # 1: before training
    old = read_csv(version1[0] / "runs.csv")
    old_spread = {step: _spread([old[f"{BASELINE}_s{s}"].validation[step] for s in version1[1]]) for step in steps}

    def row(label: str, cells: list[str]) -> str:  # the final step's cell in bold
        return f"| {label} | " + " | ".join([*cells[:-1], f"**{cells[-1]}**"]) + " |"

    def losses(name: str) -> list[str]:  # every claim seed's, "-" where the setting has no run on it
        return [" / ".join(f"{held[f'{name}_s{s}'][step]:.4f}" if f"{name}_s{s}" in held else "-" for s in seeds)
                for step in steps]

    lines = ["| step | " + " | ".join(f"{step:,}" for step in steps) + " |", "|---|" + "---:|" * len(steps),
             f"| AdamW-DDP, lr 1e-3, seeds {' / '.join(seeds)} | " + " | ".join(losses(BASELINE)) + " |",
             row(f"its std / mean (version 1's, seeds {' / '.join(version1[1])})",
                 [f"{_spread([held[f'{BASELINE}_s{s}'][step] for s in seeds]):.2%} ({old_spread[step]:.2%})"
                  for step in steps])]
    for s in SETTINGS:
        d = settings.get(s.runs)
        if not d:
            continue
        mine = sorted(d)
        lines.append(f"| {s.what} | " + " | ".join(losses(s.runs)) + " |")
        cells = []
        for step in steps:
            iv = paired_interval([held[f"{s.runs}_s{seed}"][step] / held[f"{BASELINE}_s{seed}"][step] - 1
                                  for seed in mine])
            cells.append(f"{iv.mean:+.1%} [{iv.low:+.1%}, {iv.high:+.1%}]" if iv.n > 1 else f"{iv.mean:+.1%}")
        lines.append(row(f"{s.short} vs AdamW, paired: mean [95%]", cells))
    return "\n".join(lines)


GENERATORS = {"headline": headline, "per-step": per_step}


def replace_block(text: str, name: str, new: str) -> str:
    begin, end = markers(name)
    head, _, rest = text.partition(begin)
    _, found, tail = rest.partition(end)
    if not found:
        raise ValueError(f"no {begin} ... {end} block")
    return f"{head}{begin}\n{new}\n{end}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the blocks in README.md and docs/results.md")
    args = ap.parse_args(argv)
    try:
        for name, path in BLOCKS.items():
            new = GENERATORS[name]()
            if args.write:
                path.write_text(replace_block(path.read_text(), name, new))
            else:
                print(f"{name} ({path.relative_to(REPO)}):\n{new}\n")
    except ValueError as e:
        sys.exit(f"claims: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
