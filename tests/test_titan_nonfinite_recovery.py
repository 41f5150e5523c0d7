"""End to end on CPU through torchtitan 0.2.2 (4 gloo processes = 2 replicas x 2 FSDP shards),
with bad data injected through torchtitan's own extension points (tests/titan_nan_loss.py: the
training loss is NaN on replica 1 at chosen steps):

* DiLoCo with the shipped AdamW inner optimizer: one NaN loss in the second cycle discards that
  cycle only; later outer steps run, the loss is finite and falls, replicas stay identical, and
  the skip is logged and counted;
* the per-step mode with a NaN loss at every step stops every rank after
  ``max_consecutive_skips`` skipped steps in a row, naming the replica and the parameters.
"""

import math
import re

from titan_launch import CONFIGS, REPO, launch

RUN_TIMEOUT = 400
FAULTS = {"PYTHONPATH": str(REPO / "tests")}  # where the fault's custom_import lives
WITH_NAN_LOSS = ("--model.name", "flexdemo_llama3_nanloss", "--experimental.custom_import", "titan_nan_loss")
SKIPPED = re.compile(r"flexdemo step:\s*(\d+)\s.*\sskipped_steps: (\d+)")
H, STEPS, BAD_STEP = 3, 15, 5  # step 5 is in the second cycle (steps 4-6)


def _skipped_counts(run, rank=0):
    return {int(m.group(1)): int(m.group(2)) for line in run.rank_lines(rank) if (m := SKIPPED.search(line))}


def _mean(xs):
    return sum(xs) / len(xs)


def test_diloco_discards_one_bad_cycle_and_trains_on(tmp_path, assets):
    run = launch(CONFIGS / "cpu_2x2_diloco.toml", tmp_path / "diloco", *WITH_NAN_LOSS,
                 "--training.steps", str(STEPS), "--flexdemo.sync_interval", str(H),
                 "--flexdemo.replica_check_interval", str(H),
                 assets=assets, timeout=RUN_TIMEOUT, env={**FAULTS, "FLEXDEMO_NAN_STEPS": str(BAD_STEP)})
    assert run.returncode == 0, run.output[-6000:]
    lines = run.rank_lines(0)
    text = "\n".join(lines)
    # The second outer step (after step 6) is skipped, logged naming the replica and parameters.
    warned = [line for line in lines if "skipped on every replica" in line]
    assert len(warned) == 1 and "outer step after step 6 skipped on every replica (1 skipped so far, 1 in a row)" \
        in warned[0], warned
    assert "non-finite parameters on replica 1 (tok_embeddings.weight" in warned[0], warned
    assert "with a fresh inner optimizer state" in warned[0]
    # Every outer step ran and every one after the bad cycle applied: the skip is counted once.
    for n in range(1, STEPS // H + 1):
        assert f"outer step {n} after step {n * H} " in text, n
    assert _skipped_counts(run) == {s: int(s >= 2 * H) for s in range(1, STEPS + 1)}
    # Replicas identical after every outer step, the discarded one included.
    d = run.digests()
    for step in range(H, STEPS + 1, H):
        assert d[(0, step)] == d[(2, step)] and d[(1, step)] == d[(3, step)], (step, d)
    # Replica 1's NaN shows in the logged (all-replica) loss of the bad cycle only; then it learns.
    losses = run.losses(0)
    assert math.isnan(losses[BAD_STEP]) and math.isnan(losses[BAD_STEP + 1])
    assert all(math.isfinite(losses[s]) for s in range(2 * H + 1, STEPS + 1)), losses
    # (recorded: 8.09 -> 7.79 over the 15 steps, first three against last three)
    assert _mean([losses[s] for s in range(STEPS - 2, STEPS + 1)]) < _mean([losses[s] for s in (1, 2, 3)]) - 0.15, losses


def test_per_step_mode_stops_every_rank_after_max_consecutive_skips(tmp_path, assets):
    run = launch(CONFIGS / "cpu_2x2_flexdemo.toml", tmp_path / "demo", *WITH_NAN_LOSS,
                 "--training.steps", "20", "--flexdemo.max_consecutive_skips", "3",
                 assets=assets, timeout=RUN_TIMEOUT, env={**FAULTS, "FLEXDEMO_NAN_STEPS": "3-"})
    assert run.returncode != 0, run.output[-6000:]
    for rank in range(4):
        text = "\n".join(run.rank_lines(rank))
        # Steps 3, 4, 5 in a row: every rank knows it after step 6 and stops there, alike.
        assert ("RepeatedSkipsError: flexdemo: 3 steps in a row (3..5) skipped on every replica "
                "(max_consecutive_skips = 3): a non-finite gradient on replica(s) [1]; at step 6 non-finite "
                "gradients on replica 1 (tok_embeddings.weight") in text, (rank, text[-3000:])
        for step in (3, 4, 5):
            assert f"step {step}'s update skipped on every replica: a non-finite gradient on replica(s) [1]" in text
        assert _skipped_counts(run, rank) == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3}, rank
