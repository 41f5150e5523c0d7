"""benchmarks/paired_seeds.py: each setting against the baseline on the same seeds, with the
interval and the word the results page may use."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import paired_seeds  # noqa: E402


def _csv(path, finals):
    lines = ["run,step,tokens,loss,val_loss,seconds,val_seconds,tokens_per_s,bytes_sent,bytes_received_total,bytes_modelled"]
    for run, losses in finals.items():
        for step, v in enumerate(losses, start=1):
            lines.append(f"{run},{step},1,1.0,{v},0,0,1,0,0,1")
        lines.append(f"{run},{len(losses) + 1},1,1.0,,0,0,1,0,0,1")  # a row without validation after the last
    path.write_text("\n".join(lines) + "\n")


def test_table_pairs_each_seed_with_its_baseline(tmp_path):
    _csv(tmp_path / "runs.csv", {
        "adamw_s1": [3.0, 2.0], "adamw_s2": [3.0, 2.5], "adamw_s3": [3.0, 1.6],
        "good_s1": [3.0, 1.9], "good_s2": [3.0, 2.375], "good_s3": [3.0, 1.52],   # -5% on each seed
        "mixed_s1": [3.0, 2.2], "mixed_s2": [3.0, 2.3], "mixed_s3": [3.0, 1.7],   # +10% / -8% / +6.25%
        "alone_s1": [3.0, 2.0], "other_s9": [3.0, 1.0]})
    final = paired_seeds.finals(tmp_path / "runs.csv")
    assert final["adamw_s2"] == 2.5
    text = paired_seeds.table(final, "adamw")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "-5.0% / -5.0% / -5.0%" in rows["good"] and "at or below the baseline" in rows["good"]
    d = [0.10, -0.08, 0.0625]
    mean = sum(d) / 3
    half = 4.303 * math.sqrt(sum((x - mean) ** 2 for x in d) / 2) / math.sqrt(3)
    assert f"[{mean - half:+.1%}, {mean + half:+.1%}]" in rows["mixed"] and "no difference measured" in rows["mixed"]
    assert "one seed: no claim" in rows["alone"] and "other" not in rows
    only = paired_seeds.table(final, "adamw", seeds=["1", "2"])
    assert "-5.0% / -5.0% |" in only and "seeds 1, 2," in only


@pytest.mark.parametrize("low, high, word", [(-0.3, -0.001, "at or below"), (-0.3, 0.009, "within +1%"),
                                             (0.001, 0.2, "above"), (-0.1, 0.1, "no difference")])
def test_verdicts(low, high, word):
    assert paired_seeds.verdict(low, high).startswith(word)


def test_partial_runs_are_compared_only_at_a_step_they_all_reached(tmp_path):
    # a run killed when a device session ended stops early: its last loss is not a final
    _csv(tmp_path / "runs.csv", {"adamw_s1": [3.0, 2.0, 1.0], "adamw_s2": [3.0, 2.5], "fast_s1": [2.8, 1.9, 0.9],
                                 "fast_s2": [2.9, 2.25]})
    with pytest.raises(ValueError, match="adamw_s2 2.*--step"):
        paired_seeds.finals(tmp_path / "runs.csv")
    at2 = paired_seeds.finals(tmp_path / "runs.csv", step=2)
    assert at2 == {"adamw_s1": 2.0, "adamw_s2": 2.5, "fast_s1": 1.9, "fast_s2": 2.25}
    assert set(paired_seeds.finals(tmp_path / "runs.csv", step=3)) == {"adamw_s1", "fast_s1"}
    text = paired_seeds.table(at2, "adamw", step=2)
    assert text.startswith("adamw: seeds 1, 2, held-out at step 2 2.0000 / 2.5000,") and "-5.0% / -10.0%" in text
    with pytest.raises(SystemExit, match="different validation steps"):
        paired_seeds.main([str(tmp_path)])
