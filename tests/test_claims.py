"""README's loss headline and results 11's per-step table are benchmarks/claims.py's output on the
committed runs (no number typed by hand), each measured setting names a shipped preset holding the
values its runs ran with (the launch lines in the results folder's meta.json), and the generator's
arithmetic holds on a synthetic folder whose answer is known."""

import csv
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import claims  # noqa: E402

from flexdemo.plan.intervals import paired_interval  # noqa: E402

CONFIGS = REPO / "train_configs"
# the sections whose values make the setting (job names, logging and checkpoints do not)
COMPARED = ("model", "flexdemo", "optimizer", "lr_scheduler", "training", "parallelism")


@pytest.mark.parametrize("name", sorted(claims.BLOCKS))
def test_the_docs_blocks_are_the_generators_output(name):
    begin, end = claims.markers(name)
    text = claims.BLOCKS[name].read_text()
    assert text.count(begin) == 1 and text.count(end) == 1, f"{claims.BLOCKS[name].name}: one {name} block"
    inside = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert inside == claims.GENERATORS[name](), f"{name} is stale: python3 benchmarks/claims.py --write"


def ran_as() -> dict[str, tuple[str, list[str]]]:
    """Run name prefix (before _sSEED) -> (config, flags: --common's, then the job's), from the results
    folder's launch lines (`gpu.sh detach runs [--option value | --shared-gpu ...] "NAME CONFIG FLAGS" ...`)."""
    out = {}
    for line in json.loads((claims.FOLDER / "meta.json").read_text())["reproduce"]:
        argv = shlex.split(line, comments=True)
        if argv[:4] != ["bash", "benchmarks/gpu.sh", "detach", "runs"]:
            continue
        options, jobs, rest = {}, [], argv[4:]
        while rest:
            if rest[0] == "--shared-gpu":
                rest = rest[1:]
            elif rest[0].startswith("--"):
                options[rest[0]], rest = rest[1], rest[2:]
            else:
                jobs.append(rest.pop(0))
        for job in jobs:
            name, config, *flags = shlex.split(job)
            out[name.rsplit("_s", 1)[0]] = (config, shlex.split(options.get("--common", "")) + flags)
    return out


def with_flags(config: dict, flags: list[str]) -> dict:
    """The config's sections with --section.key value flags applied (the value typed as the key's own)."""
    out = {k: dict(v) for k, v in config.items() if isinstance(v, dict)}
    i = 0
    while i < len(flags):
        section, key = flags[i][2:].split(".", 1)
        if key.startswith("no-"):
            out.setdefault(section, {})[key[3:]] = False
            i += 1
            continue
        value, old = flags[i + 1], out.get(section, {}).get(key)
        out.setdefault(section, {})[key] = (
            value.lower() == "true" if isinstance(old, bool) else type(old)(value) if old is not None else value)
        i += 2
    return out


def _sections(config: str, flags: list[str]) -> dict:
    return {k: v for k, v in with_flags(tomllib.loads((CONFIGS / config).read_text()), flags).items() if k in COMPARED}


def test_every_measured_setting_ships_as_a_preset_with_its_runs_values():
    """A measured setting's preset holds, as its own values, what its runs ran with (its launch line's
    config with the line's flags), training.steps aside (a run's length: the comparison's --common
    sets 3,990); the baseline's config with the flags the headline names does too."""
    runs = ran_as()
    measured = [(s.runs, s.preset, []) for s in claims.SETTINGS if s.runs in runs]
    assert measured, "no headline setting has runs: the test checks nothing"
    base_config, base_flags = claims.BASELINE_CONFIG
    for name, preset, flags in [(claims.BASELINE, base_config, shlex.split(base_flags)), *measured]:
        assert preset, f"{name} is measured: the headline names a shipped preset for it"
        config, ran_flags = runs[name]
        ran = _sections(f"{config}.toml", ran_flags)
        shipped = _sections(preset, flags)
        for got in (ran, shipped):
            got.get("training", {}).pop("steps", None)
        assert shipped == ran, (name, preset, flags)


def test_a_setting_whose_preset_differs_from_its_runs_is_refused(monkeypatch):
    wrong = claims.Setting("sparseloco_olr3", "x", "gpu_2gpu_sparseloco.toml", "x")  # outer lr 1, not 3
    monkeypatch.setattr(claims, "SETTINGS", (wrong,))
    with pytest.raises(AssertionError):
        test_every_measured_setting_ships_as_a_preset_with_its_runs_values()


def _write_runs(folder: Path, rows: list[dict]) -> None:
    folder.mkdir()
    with open(folder / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_the_block_on_a_folder_whose_answer_is_known(tmp_path):
    """AdamW's rows as committed, plus top16_s* made from them: each final held-out loss 2% above its
    seed's AdamW, bytes a tenth of B (the fp32 counter / 20): +2.0% per seed, an interval of zero
    width, above the baseline, 10x fewer."""
    with open(claims.FOLDER / "runs.csv", newline="") as f:
        adamw = [r for r in csv.DictReader(f) if r["run"].rsplit("_s", 1)[0] == "adamw"]
    made = []
    for r in adamw:
        t = dict(r, run="top16_s" + r["run"].rsplit("_s", 1)[1], bytes_modelled="0")
        if r["val_loss"]:
            t["val_loss"] = f"{float(r['val_loss']) * 1.02:.6f}"
        if r["bytes_received_total"]:
            t["bytes_received_total"] = str(int(r["bytes_received_total"]) // 20)
        made.append(t)
    _write_runs(tmp_path / "f", adamw + made)
    out = claims.headline(tmp_path / "f")
    row = next(line for line in out.splitlines() if line.startswith("| per-step `demo`, top-16"))
    assert "+2.0% / +2.0% / +2.0% / +2.0%" in row and "**+2.0% [+2.0%, +2.0%]" in row
    assert "above the baseline" in row and row.endswith("| 10x fewer |")
    assert "std / mean: 0.84%" in out  # AdamW's committed finals 1.9328 / 1.9133 / 1.9503 / 1.9443
    assert "Not yet measured on this corpus: `demo_diloco`" in out and "top-16" not in out.split("Not yet")[1]
    table = claims.per_step(tmp_path / "f")
    paired_row = next(line for line in table.splitlines() if line.startswith("| top-16 vs AdamW"))
    assert paired_row.count("+2.0% [+2.0%, +2.0%]") == 5, paired_row  # 798, 1,596, 2,394, 3,192, 3,990
    assert "**0.84% (10.24%)**" in table  # the finals' spread beside corpus version 1's


# the folders whose paired intervals the docs may quote, with the seeds a claim pairs over
INTERVAL_SOURCES = ((claims.FOLDER, claims.SEEDS), claims.VERSION1)
INTERVAL = re.compile(r"[+-]\d+\.\d% \[[+-]\d+\.\d%, [+-]\d+\.\d%\]")


def intervals_the_runs_give() -> set[str]:
    """Every setting's paired interval (mean [low, high]) at every validation step its seeds and the
    baseline's share, in each source folder."""
    out = set()
    for folder, seeds in INTERVAL_SOURCES:
        runs = claims.read_csv(folder / "runs.csv")
        held = {name: run.validation for name, run in runs.items()}
        settings = {name.rsplit("_s", 1)[0] for name in held} - {claims.BASELINE}
        for setting in settings:
            mine = [s for s in seeds if f"{setting}_s{s}" in held and f"{claims.BASELINE}_s{s}" in held]
            if len(mine) < 2:
                continue
            steps = set.intersection(*(set(held[f"{n}_s{s}"]) for s in mine for n in (setting, claims.BASELINE)))
            for step in steps:
                iv = paired_interval([held[f"{setting}_s{s}"][step] / held[f"{claims.BASELINE}_s{s}"][step] - 1
                                      for s in mine])
                out.add(f"{iv.mean:+.1%} [{iv.low:+.1%}, {iv.high:+.1%}]")
    return out


def quoted_intervals() -> dict[str, set[str]]:
    pages = [REPO / "README.md", REPO / "benchmarks" / "README.md", *(REPO / "docs").glob("*.md"),
             *(REPO / "train_configs").iterdir(), *(REPO / "docs" / "results").glob("*/meta.json")]
    return {str(p.relative_to(REPO)): set(INTERVAL.findall(p.read_text())) for p in pages if p.is_file()}


def test_every_interval_the_docs_quote_is_one_the_runs_give():
    given = intervals_the_runs_give()
    quoted = quoted_intervals()
    assert sum(map(len, quoted.values())) >= 5, "the docs quote no interval: the test checks nothing"
    stale = {page: sorted(found - given) for page, found in quoted.items() if found - given}
    assert stale == {}, f"intervals no committed runs give (typed by hand, or stale): {stale}"


def test_a_setting_missing_a_seed_shows_which(tmp_path):
    """A setting with no run on seed 44 (one killed, say): '-' in that seed's place, the interval over
    the three it has."""
    with open(claims.FOLDER / "runs.csv", newline="") as f:
        adamw = [r for r in csv.DictReader(f) if r["run"].rsplit("_s", 1)[0] == "adamw"]
    made = [dict(r, run="top16_s" + r["run"].rsplit("_s", 1)[1],
                 val_loss=f"{float(r['val_loss']) * 1.02:.6f}" if r["val_loss"] else "")
            for r in adamw if not r["run"].endswith("_s44")]
    _write_runs(tmp_path / "f", adamw + made)
    row = next(line for line in claims.headline(tmp_path / "f").splitlines() if line.startswith("| per-step"))
    assert "| +2.0% / +2.0% / +2.0% / - |" in row and "(95%, 3 seeds)" in row
    losses = next(line for line in claims.per_step(tmp_path / "f").splitlines() if line.startswith("| per-step"))
    assert losses.count(" / -") == 5
