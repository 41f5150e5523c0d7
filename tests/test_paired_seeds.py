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


def _log(path, corpus, heldout, loss, card="", steps=1):
    """A run's console log as flexdemo's loaders and torchtitan's trainer and validator write it (rank 0):
    ``steps`` its training.steps (it validates once, at step 1)."""
    at = "[rank0]:[titan] 2026-12-05 10:00:00,000 - root - INFO - "
    lines = [f"CUDA capacity: {card} with 79.18GiB memory" if card else "Building llama3 small",
             "Trainer is initialized with local batch size 8, global batch size 16, gradient accumulation steps 1, "
             f"sequence length 16, total steps {steps} (warmup 2)",
             f"flexdemo_pysource2: 9 documents, ~0.1 M tokens from /cache/x (corpus_sha256={corpus}), dp 0/2"
             if corpus else "c4: a dataset of torchtitan's", "step:  1  loss:  7.0  grad_norm:  1.0  memory:  1.00GiB(1.00%)  "
             "tps: 1,000  tflops: 0.1  mfu: 0.01%",
             f"flexdemo_pysource2_validation: 64 windows of 16 + 1 tokens from 9 documents; each validation scores "
             f"windows 0..63 (1,024 tokens), rank 0 of 2 every 2th from window 0; heldout_digest={heldout}"
             if heldout else "validation on torchtitan's loader", f"validate step:  1  loss:  {loss}  memory:  1.00GiB(1.00%)"]
    path.write_text("".join(at + line + "\n" for line in lines))


def test_runs_that_read_different_data_are_not_paired(tmp_path):
    # Batches run in different device sessions build the corpus anew on each machine: a run whose log
    # names another corpus or held-out digest, or none beside runs that name one, is not paired.
    import plot
    import titan_logs

    same = ("ab12" * 4, "cd34" * 16)
    runs = {"adamw_s1": (*same, 2.0), "adamw_s2": (*same, 2.5), "k8_s1": (*same, 2.2), "k8_s2": (*same, 2.75)}

    def table(**changed):
        for name, (corpus, heldout, loss) in {**runs, **changed}.items():
            _log(tmp_path / f"{name}.log", corpus, heldout, loss)
        plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(p) for p in sorted(tmp_path.glob("*.log"))])
        final = paired_seeds.finals(tmp_path / "runs.csv")
        return paired_seeds.table(final, "adamw", data=paired_seeds.data_read(tmp_path / "runs.csv"))

    assert f"held-out digest {'cd34' * 4}" in table() and "+10.0% / +10.0%" in table()
    with pytest.raises(ValueError, match=r"read different data.*ee.*k8_s2"):
        table(k8_s2=(same[0], "ee" * 32, 2.75))  # another held-out set
    with pytest.raises(ValueError, match=r"read different data.*ff.*adamw_s1"):
        table(adamw_s1=("ff" * 8, same[1], 2.0))  # another training corpus
    with pytest.raises(ValueError, match=r"not logged / not logged: k8_s1"):
        table(k8_s1=("", "", 2.2))  # a log that does not say beside ones that do
    with pytest.raises(SystemExit, match="read different data"):
        paired_seeds.main([str(tmp_path)])  # (the last CSV written: k8_s1 says nothing)
    table(other_s3=("", "", 9.0))  # a run outside the pairing (no baseline on its seed) is not compared


def test_runs_on_different_cards_are_not_paired(tmp_path):
    # One seed on an H100 and on an H200 reads the same data and starts bit-identical, then parts by as
    # much as two seeds do: a pairing across cards would count the card as the setting's effect.
    import plot
    import titan_logs

    same = ("ab12" * 4, "cd34" * 16)
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    runs = {"adamw_s1": (*same, 2.0, h100), "adamw_s2": (*same, 2.5, h100),
            "k8_s1": (*same, 2.2, h100), "k8_s2": (*same, 2.75, h100)}

    def table(**changed):
        for name, (corpus, heldout, loss, card) in {**runs, **changed}.items():
            _log(tmp_path / f"{name}.log", corpus, heldout, loss, card)
        plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(p) for p in sorted(tmp_path.glob("*.log"))])
        final = paired_seeds.finals(tmp_path / "runs.csv")
        return paired_seeds.table(final, "adamw", data=paired_seeds.data_read(tmp_path / "runs.csv"))

    text = table()
    assert f"on {h100}" in text and "+10.0% / +10.0%" in text
    assert plot.read_csv(tmp_path / "runs.csv")["k8_s2"].card == h100  # the CSV keeps it
    with pytest.raises(ValueError, match=rf"different cards.*{h200}: k8_s2"):
        table(k8_s2=(*same, 2.75, h200))
    with pytest.raises(ValueError, match=r"different cards.*not logged: adamw_s1"):
        table(adamw_s1=(*same, 2.0, ""))  # a log that does not name its card beside ones that do


def test_runs_all_stopped_before_their_end_have_no_finals(tmp_path):
    # A device session that ends kills a whole batch at once: every run's last validation is the same
    # step, but not the one it was to end at. Its losses there are no finals.
    import plot
    import titan_logs

    same = ("ab12" * 4, "cd34" * 16)
    for name, loss in {"adamw_s1": 2.0, "adamw_s2": 2.5, "k8_s1": 2.2, "k8_s2": 2.75}.items():
        _log(tmp_path / f"{name}.log", *same, loss, steps=3990)
    plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(p) for p in sorted(tmp_path.glob("*.log"))])
    assert plot.read_csv(tmp_path / "runs.csv")["k8_s1"].steps_planned == 3990
    with pytest.raises(SystemExit, match="without a held-out loss at their last step.*adamw_s1 validated last at 1 of 3990"):
        paired_seeds.main([str(tmp_path)])
    assert "+10.0% / +10.0%" in paired_seeds.table(paired_seeds.finals(tmp_path / "runs.csv", step=1), "adamw", step=1)
    for name in ("adamw_s1", "adamw_s2", "k8_s1", "k8_s2"):  # the same runs, ended where they were to
        _log(tmp_path / f"{name}.log", *same, {"adamw_s1": 2.0, "adamw_s2": 2.5, "k8_s1": 2.2, "k8_s2": 2.75}[name])
    plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(p) for p in sorted(tmp_path.glob("*.log"))])
    assert paired_seeds.main([str(tmp_path)]) == 0


def test_batches_in_separate_folders_pair_as_one(tmp_path, capsys):
    # A comparison whose baseline and settings ran in different sessions, kept in two folders.
    base, batch = tmp_path / "baseline", tmp_path / "batch"
    base.mkdir(), batch.mkdir()
    _csv(base / "runs.csv", {"adamw_s1": [3.0, 2.0], "adamw_s2": [3.0, 2.5]})
    _csv(batch / "runs.csv", {"fast_s1": [3.0, 2.2], "fast_s2": [3.0, 2.75]})
    with pytest.raises(SystemExit, match="no adamw_sSEED runs"):
        paired_seeds.main([str(batch)])
    assert paired_seeds.main([str(base), str(batch)]) == 0
    assert "| fast | 1, 2 | +10.0% / +10.0% |" in capsys.readouterr().out
    _csv(batch / "runs.csv", {"fast_s1": [3.0, 2.2], "adamw_s2": [3.0, 2.4]})  # a run in both: which is it?
    with pytest.raises(SystemExit, match="run adamw_s2 is in both .*baseline/runs.csv and .*batch/runs.csv"):
        paired_seeds.main([str(base), str(batch)])
    # A rerun appended to its folder beside the killed run's rows: refused, not merged step by step.
    again = (batch / "runs.csv").read_text().splitlines()[1:]
    with open(batch / "runs.csv", "a") as f:
        f.write("\n".join(again) + "\n")
    with pytest.raises(SystemExit, match="run fast_s1 has step 1 twice in .*batch/runs.csv"):
        paired_seeds.main([str(batch)])
