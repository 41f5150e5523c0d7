"""The shaped-link script's time-to-loss arithmetic, on hand-written logs whose answers are worked
out here, and plot.py's compact CSV summaries (no training: the scripts' real runs are summarized in
docs/results.md)."""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest

from titan_launch import REPO, cache_holding

sys.path.insert(0, str(REPO / "benchmarks"))
import plot  # noqa: E402
import shaped_link  # noqa: E402
import summarize_logs  # noqa: E402
import titan_logs  # noqa: E402

T0 = datetime(2026, 11, 26, 11, 0, 0)


def _line(seconds: float, text: str) -> str:
    stamp = (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
    return f"[rank0]:[titan] {stamp} - root - INFO - {text}"


def _log(path, step_seconds, validation, bytes_per_step=0, modelled=False, steps=20):
    """step s logged at step_seconds(s); validation {step: loss} logged 0.1 s after its step."""
    suffix = "_modelled" if modelled else ""
    lines = [_line(0, "Trainer is initialized with local batch size 4, global batch size 8, gradient "
                      "accumulation steps 1, sequence length 16, total steps 20 (warmup 1)")]
    for s in range(1, steps + 1):
        t = step_seconds(s)
        lines.append(_line(t, f"step: {s:2d}  loss:  7.0  grad_norm:  1.0  memory:  1.00GiB(1.00%)  "
                              "tps: 1,000  tflops: 0.1  mfu: 0.01%"))
        lines.append(_line(t, f"flexdemo step: {s:2d}  sent_bytes{suffix}: {bytes_per_step}  received_bytes"
                              f"{suffix}: {bytes_per_step}  sent_bytes_total{suffix}: {s * bytes_per_step}  "
                              f"received_bytes_total{suffix}: {s * bytes_per_step}  optimizer_step_ms: 1.0"))
        if s in validation:
            lines.append(_line(t + 0.1, f"validate step: {s:2d}  loss:  {validation[s]}  memory:  1.00GiB(1.00%)"))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def results(tmp_path):
    # AdamW: its loss curve from a 20-step run off the link (final validation 5.0 = the target),
    # its step time from 3 steps on the link: steps 1..3 at 10, 12, 14 s -> 2 s per step.
    _log(tmp_path / "adamw_reference.log", lambda s: 0.1 * s, {10: 6.0, 20: 5.0}, 100, modelled=True)
    _log(tmp_path / "adamw.log", lambda s: 10 + 2.0 * (s - 1), {}, 100, modelled=True, steps=3)
    # FlexDeMo: a step every 0.5 s; validation 4.9 at step 10, logged at 4.5 + 0.1 s.
    _log(tmp_path / "flexdemo.log", lambda s: 0.5 * (s - 1), {10: 4.9, 20: 4.5}, 7)
    # demo_diloco never gets to 5.0.
    _log(tmp_path / "demo_diloco.log", lambda s: 0.25 * (s - 1), {10: 5.5, 20: 5.01}, 3)
    args = argparse.Namespace(sync_interval=5, log_freq=1, adamw_buckets=4, rtt_ms=20.0, rate="1gbit", steps=20)
    table = shaped_link.table(tmp_path, args)
    return table, json.loads((tmp_path / "results.json").read_text())


def test_time_to_adamw_final_loss(results):
    table, res = results
    assert res["target"] == 5.0
    m = res["methods"]
    # AdamW: 20 steps x 2 s measured on the link; the RTT model adds 20 steps x (4 buckets + the
    # token count + 2 logging all-reduces per step) x 20 ms = 2.8 s.
    assert m["adamw"]["reached_at_step"] == 20
    assert m["adamw"]["seconds_per_step"] == pytest.approx(2.0)
    assert m["adamw"]["seconds_to_target"] == pytest.approx(40.0)
    assert m["adamw"]["seconds_to_target_with_rtt"] == pytest.approx(42.8)
    assert m["adamw"]["how"].startswith("extrapolated")
    # FlexDeMo: first at or below 5.0 at step 10, 4.6 s after step 1; + 10 x (1 + 2) x 20 ms.
    assert m["flexdemo"]["reached_at_step"] == 10
    assert m["flexdemo"]["seconds_to_target"] == pytest.approx(4.6)
    assert m["flexdemo"]["seconds_to_target_with_rtt"] == pytest.approx(5.2)
    assert m["flexdemo"]["bytes_received_total"] == 20 * 7
    assert m["demo_diloco"]["reached_at_step"] is None and m["demo_diloco"]["how"] == "not reached"
    # The table's speed-up column: 42.8 / 5.2.
    row = next(line for line in table.splitlines() if line.startswith("| flexdemo |"))
    assert f"{42.8 / 5.2:.1f}x" in row


def test_a_method_timed_on_the_link_for_a_few_steps_takes_its_curve_from_its_reference(tmp_path):
    # AdamW as in the fixture; diloco (H = 5) ran 12 steps on the link, every step logged, with
    # each outer step (steps 5 and 10) costing 3 s more: whole cycles give 1 + 3/5 s per step.
    # Its curve (a 20-step run off the link, 9 bytes a step) first reaches 5.0 at step 20.
    _log(tmp_path / "adamw_reference.log", lambda s: 0.1 * s, {10: 6.0, 20: 5.0}, 100, modelled=True)
    _log(tmp_path / "adamw.log", lambda s: 10 + 2.0 * (s - 1), {}, 100, modelled=True, steps=3)
    _log(tmp_path / "diloco_reference.log", lambda s: 0.1 * s, {10: 5.2, 20: 4.95}, 9)
    _log(tmp_path / "diloco.log", lambda s: 1.0 * s + 3.0 * (s // 5), {}, 1, steps=12)
    args = argparse.Namespace(sync_interval=5, log_freq=1, adamw_buckets=4, rtt_ms=0.0, rate="1gbit", steps=20)
    shaped_link.table(tmp_path, args)
    m = json.loads((tmp_path / "results.json").read_text())["methods"]["diloco"]
    assert m["seconds_per_step"] == pytest.approx(1.6)  # not (17 s / 11 steps) over the uneven span 1..12
    assert m["reached_at_step"] == 20 and m["seconds_to_target"] == pytest.approx(32.0)
    assert m["how"].startswith("extrapolated") and m["validation_loss"] == 4.95
    assert m["bytes_received_total"] == 20 * 9 and (m["steps"], m["curve_steps"]) == (12, 20)
    # Had diloco not reached 5.0 in its 20 steps (32 s), FlexDeMo reaching it in 4.6 s is at
    # least 32 / 4.6 times sooner than diloco, and the table says "at least".
    _log(tmp_path / "diloco_reference.log", lambda s: 0.1 * s, {10: 5.2, 20: 5.1}, 9)
    _log(tmp_path / "flexdemo.log", lambda s: 0.5 * (s - 1), {10: 4.9, 20: 4.5}, 7)
    table = shaped_link.table(tmp_path, args)
    m = json.loads((tmp_path / "results.json").read_text())["methods"]
    assert m["diloco"]["how"] == "not reached" and m["diloco"]["whole_run_seconds_with_rtt"] == pytest.approx(32.0)
    row = next(line for line in table.splitlines() if line.startswith("| flexdemo |"))
    assert f"| >= {32 / 4.6:.2f}x |" in row


def test_seconds_per_step_spans_whole_cycles():
    # 1 s a step and 3 s more at every 5th (a sync), each step logged after it: 1.6 s per step
    # over whole cycles; the span from step 1 (24 steps, 5 syncs) says 39 / 24 = 1.625.
    run = titan_logs.RunLog("x")
    run.step_time = {s: (s - 1) + 3.0 * (s // 5) for s in (1, 5, 10, 20, 25)}
    assert titan_logs.seconds_per_step(run) == pytest.approx(39.0 / 24)
    assert titan_logs.seconds_per_step(run, cycle=5) == pytest.approx(1.6)  # steps 5 -> 25
    assert math.isnan(titan_logs.seconds_per_step(run, cycle=100))
    # The first outer step compiles its kernels (12 s more): no whole-cycle span includes it.
    run.step_time = {s: (s - 1) + 3.0 * (s // 5) + (12.0 if s >= 5 else 0.0) for s in range(1, 26)}
    assert titan_logs.seconds_per_step(run, cycle=5) == pytest.approx(1.6)


def test_shaped_link_link_steps_and_references_are_checked(tmp_path):
    assert shaped_link.parse_link_steps("adamw:20,diloco:65") == {"adamw": 20, "diloco": 65}
    assert shaped_link.parse_link_steps("") == {}
    for bad in ("adamw", "adamw:0", "adam:5", "diloco:x"):
        with pytest.raises(ValueError, match="--link-steps"):
            shaped_link.parse_link_steps(bad)
    log = tmp_path / "a.log"
    log.write_text("")
    assert shaped_link.parse_references(f"flexdemo:{log}") == {"flexdemo": log}
    for bad in (f"flexdemoo:{log}", "flexdemo", f"flexdemo:{tmp_path / 'missing.log'}"):
        with pytest.raises(ValueError, match="--reference"):
            shaped_link.parse_references(bad)


def test_shaped_link_refuses_link_steps_or_references_it_would_ignore(tmp_path):
    methods = shaped_link.parse_methods("adamw,flexdemo,diloco:2000", 1000)
    shaped_link.check_link_plan(methods, {"adamw": 10, "diloco": 65}, {"adamw": tmp_path / "a.log"})
    for link, refs, what in [({"demo_diloco": 5}, {}, "not in --methods"),
                             ({"adamw": 1000}, {}, "not fewer than its 1000 steps"),
                             ({"diloco": 2000}, {}, "not fewer than its 2000 steps"),
                             ({"adamw": 10}, {"flexdemo": tmp_path / "f.log"}, "runs all its steps on the link")]:
        with pytest.raises(ValueError, match=what):
            shaped_link.check_link_plan(methods, link, refs)


def test_shaped_link_methods_take_their_own_steps():
    assert shaped_link.parse_methods("adamw,diloco:2000", 1000) == [("adamw", 1000), ("diloco", 2000)]
    for bad in ("diloco:", "diloco:0", "diloco:x", "dilocco", "adamw,,flexdemo"):
        with pytest.raises(ValueError, match="--methods"):
            shaped_link.parse_methods(bad, 1000)


def test_shaped_link_table_only_tabulates_without_root_or_training(results, tmp_path):
    # The folder the `results` fixture filled: --table-only reads it back the same way, as any
    # user (no namespaces, no runs).
    table, _ = results
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "shaped_link.py"), "--table-only", "--out",
                          str(tmp_path), "--sync-interval", "5", "--log-freq", "1", "--steps", "20"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == table.strip()


def test_validation_table_ratios(tmp_path):
    # AdamW: 4.0 held-out, 1000 bytes a step modelled; diloco 4.2 and 50 a step; demo_diloco 4.08
    # and 2 a step (measured), never validated at step 10.
    _log(tmp_path / "adamw.log", lambda s: 0.1 * s, {10: 4.5, 20: 4.0}, 1000, modelled=True)
    _log(tmp_path / "diloco.log", lambda s: 0.1 * s, {10: 4.6, 20: 4.2}, 50)
    _log(tmp_path / "demo_diloco.log", lambda s: 0.1 * s, {20: 4.08}, 2)
    # A run cut off after step 10 has no loss at the baseline's last step: no comparison.
    _log(tmp_path / "cut.log", lambda s: 0.1 * s, {10: 4.4}, 2, steps=10)
    runs = [titan_logs.parse(tmp_path / f"{n}.log") for n in ("adamw", "diloco", "demo_diloco", "cut")]
    table = summarize_logs.validation_table(runs, "adamw", ("adamw", "diloco"))
    header, _, *rows = table.splitlines()
    assert header.split(" | ")[1:3] == ["val @10", "val @20"]
    cells = {r.split(" | ")[0][2:]: r.strip("| ").split(" | ")[1:] for r in rows}
    assert cells["adamw"] == ["4.5000", "4.0000", "20,000 (modelled)", "1,000", "+0.0%", "1", "0.05"]
    assert cells["diloco"] == ["4.6000", "4.2000", "1,000", "1,000", "+5.0%", "20", "1"]
    # 4.08 / 4.0 - 1 = +2.0%; 20,000 / 40 = 500x fewer than AdamW, 1,000 / 40 = 25x fewer than diloco.
    assert cells["demo_diloco"] == ["-", "4.0800", "40", "1,000", "+2.0%", "500", "25"]
    assert cells["cut"] == ["4.4000", "-", "20", "1,000", "-", "1,000", "50"]
    with pytest.raises(SystemExit, match="no run named 'ddp'"):
        summarize_logs.validation_table(runs, "ddp")


def test_runs_gives_each_job_its_own_gpus(monkeypatch):
    import runs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert runs.device_slots(2) == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert runs.device_slots(2) == ["0,1"]  # a lone GPU left over is not a slot


def test_shaped_link_check_interval_follows_sync_interval(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[flexdemo]\nreplica_check_interval = 128\n")
    # Rounded up to a multiple of H, the config's own interval when it already is one.
    assert [shaped_link.check_interval(cfg, h) for h in (32, 50, 5, 200)] == [128, 150, 130, 200]
    cfg.write_text("[flexdemo]\nreplica_check_interval = 0\n")  # 0 = no checks, kept
    assert shaped_link.check_interval(cfg, 32) == 0


def _alive_with(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def test_runs_timeout_stops_torchruns_workers(tmp_path, assets):
    # A real job through scripts/launch.sh (torchrun, 4 gloo workers in sessions of their own),
    # cut off by --timeout while it trains: nothing of it may keep running. 60 s: on a loaded 2-core
    # machine the four workers took more than 25 s to start training.
    name = f"timeout_probe_{os.getpid()}"
    env = {**os.environ, "FLEXDEMO_CACHE": cache_holding(assets), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "runs.py"), "--out", str(tmp_path), "--timeout", "60",
         f"{name} cpu_2x2_flexdemo --training.steps 100000"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    log = (tmp_path / f"{name}.log").read_text()
    assert f"=== {name}: killed after 60 s" in proc.stdout, proc.stdout + proc.stderr
    assert "Starting job" in log, log[-3000:]  # its workers were running when it was killed
    time.sleep(1)
    left = _alive_with(f"/tmp/variants/{name}")
    for pid in left:  # a failing run must not leave them behind either
        os.kill(pid, 9)
    assert left == [], log[-2000:]


def test_plot_csv_keeps_what_the_plots_and_tables_read(results, tmp_path):
    # The `results` fixture's shaped-link folder, reduced to runs.csv + results.json: the series
    # drawn from the CSV equal those drawn from the logs (losses, tokens, bytes, the time axis
    # with its RTT model and extrapolation), and the table helpers read the same numbers back.
    logs = sorted(tmp_path.glob("*.log"))
    plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(p) for p in logs])
    compact = tmp_path / "compact"
    compact.mkdir()
    (compact / "runs.csv").write_text((tmp_path / "runs.csv").read_text())
    (compact / "results.json").write_text((tmp_path / "results.json").read_text())
    from_logs, from_csv = plot.shaped_link_series(tmp_path), plot.shaped_link_series(compact)
    assert [s.label for s in from_csv] == [s.label for s in from_logs]
    for a, b in zip(from_logs, from_csv):
        assert (a.step, a.loss, a.tokens, a.bytes) == (b.step, b.loss, b.tokens, b.bytes)
        assert b.seconds == pytest.approx(a.seconds, abs=0.01)
    # AdamW's curve from its reference, timed at 2 s per measured step + 7 collectives x 20 ms
    # (4 buckets + the token count + the logged loss's 2 all-reduces at log_freq 1).
    adamw = next(s for s in from_csv if s.label.startswith("adamw"))
    assert adamw.loss == [6.0, 5.0] and adamw.seconds == pytest.approx([10 * 2.14, 20 * 2.14])
    assert adamw.label.endswith("[bytes modelled]")
    runs = plot.read_csv(compact / "runs.csv")
    flex = runs["flexdemo"]
    assert flex.tokens_per_step == 128 and flex.validation == {10: 4.9, 20: 4.5}
    assert titan_logs.last_exchange(flex).received_total == 20 * 7
    assert titan_logs.mean_tokens_per_s(flex) == 1000
    assert summarize_logs.validation_table(list(runs.values())) == summarize_logs.validation_table(
        [titan_logs.parse(p) for p in logs])


def test_plot_draws_from_the_csv(results, tmp_path):
    pytest.importorskip("matplotlib")
    plot.write_csv(tmp_path / "runs.csv", [titan_logs.parse(tmp_path / "flexdemo.log")])
    out = tmp_path / "plots"
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--csv", str(tmp_path / "runs.csv"),
                        "--runs", "flexdemo", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["loss_vs_bytes.png", "loss_vs_time.png", "loss_vs_tokens.png"]
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--csv", str(tmp_path / "runs.csv"),
                          "--runs", "nope", "--out", str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "no run ['nope']" in bad.stderr


def test_shaped_link_puts_one_replica_on_each_of_n_nodes():
    # 2 CPU nodes keep the 2 x 2 layout (FSDP inside a node); otherwise one rank and one replica per node.
    assert shaped_link.layout_flags("cpu", 2) == []
    assert shaped_link.layout_flags("gpu", 4) == ["--parallelism.data_parallel_replicate_degree", "4",
                                                  "--parallelism.data_parallel_shard_degree", "1"]
    env = shaped_link.node_env(3, 4, "gpu", 29500, REPO)
    assert (env["NNODES"], env["NODE_RANK"], env["NPROC"], env["CUDA_VISIBLE_DEVICES"]) == ("4", "3", "1", "3")
    assert env["MASTER_ADDR"] == shaped_link.node_addr(0) != env["LOCAL_ADDR"] == shaped_link.node_addr(3)
    assert shaped_link.collectives_per_step("flexdemo_sharded", 32, 10, 4) == 2 + 2 / 10


def test_interval_frontier_pairs_seeds_and_draws_each_setting_once(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [("adamw_s1", 3.0), ("adamw_s2", 4.0), ("adamw_s3", 2.0),
            ("k8_s1", 3.3), ("k8_s2", 4.4), ("k8_s3", 2.2),     # +10% on every seed
            ("k16_s1", 2.7), ("k16_s2", 4.4), ("k4_s1", 3.0)]  # -10% / +10%; one seed
    with open(tmp_path / "runs.csv", "w") as f:
        f.write(",".join(plot.FIELDS) + "\n")
        for name, loss in rows:
            f.write(f"{name},10,,,{loss},,,,,{1_000_000 if name.startswith('adamw') else 1_000},"
                    f"{int(name.startswith('adamw'))}\n")
    path, table = plot.interval_frontier(plot.read_csv(tmp_path / "runs.csv"), tmp_path / "out", "adamw")
    assert path.is_file() and path.name == "loss_vs_bytes_intervals.png"
    rows = {r.split(" | ")[0].strip("| "): r for r in table.splitlines() if r.startswith("| ") and "---" not in r}
    assert "+10.0% [+10.0%, +10.0%] (95%, 3 seeds)" in rows["k8"] and "above the baseline" in rows["k8"]
    assert "(95%, 2 seeds)" in rows["k16"] and "no difference measured" in rows["k16"]
    assert "one seed: no claim" in rows["k4"]
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--frontier", str(tmp_path / "runs.csv"),
                        "--intervals", "--seeds", "1", "2", "--out", str(tmp_path / "cli")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "seeds 1, 2," in r.stdout and (tmp_path / "cli" / "loss_vs_bytes_intervals.png").is_file()
    with open(tmp_path / "runs.csv", "a") as f:  # a run killed early: its last loss is no final
        f.write("k8_s4,5,,,2.0,,,,,1000,0\n")
    with pytest.raises(ValueError, match="k8_s4 5"):
        plot.interval_frontier(plot.read_csv(tmp_path / "runs.csv"), tmp_path / "out", "adamw")


def test_frontier_compares_each_run_with_the_baseline_of_its_seed(tmp_path):
    pytest.importorskip("matplotlib")
    fields = plot.FIELDS
    rows = [  # run, last validated step's loss, bytes received in total by then
        ("adamw_lr5e-4_s1", 2.5, 1_000_000),  # a baseline variant: not the target of seed 1
        ("adamw_s1", 3.0, 1_000_000), ("adamw_s2", 4.0, 1_000_000),
        ("k8_s1", 3.3, 1_000), ("k8_s2", 3.0, 2_000), ("k8_1b_s2", 2.0, 500)]
    with open(tmp_path / "runs.csv", "w") as f:
        f.write(",".join(fields) + "\n")
        for name, loss, nbytes in rows:
            modelled = int(name.startswith("adamw"))  # AdamW's fp32 all-reduce counter is modelled
            f.write(f"{name},5,,,9.0,,,,,{nbytes // 2},{modelled}\n")  # an earlier validation, half the bytes
            f.write(f"{name},10,,,{loss},,,,,{nbytes},{modelled}\n")
    # k8_s1 re-sent with a lossless coding at a quarter of its bytes: its loss, those bytes
    path, table = plot.frontier(plot.read_csv(tmp_path / "runs.csv"), tmp_path / "out", "adamw",
                                same_bits=(("k8_ef_s1", "k8_s1", 250),))
    assert path.is_file()
    assert "| B / it |" in table.splitlines()[0]
    lines = {row.split(" | ")[0].strip("| "): row.split(" | ")[1:] for row in table.splitlines()[2:]}
    assert lines["k8_ef_s1 (the bits of k8_s1)"] == ["3.3000", "+10.0%", "250", "2,000x |"]
    # k8_s1 against adamw_s1: 3.3 / 3.0 = +10%; k8_s2 against adamw_s2. Bytes against B, a bf16
    # ring: half AdamW's fp32 counter (1e6 over 10 steps): 5e5.
    assert lines["k8_s1"] == ["3.3000", "+10.0%", "1,000", "500x |"]
    assert lines["k8_s2"] == ["3.0000", "-25.0%", "2,000", "250x |"]
    assert lines["k8_1b_s2"] == ["2.0000", "-50.0%", "500", "1,000x |"]
    assert lines["adamw_s2"][1] == "+0.0%" and lines["adamw_s2"][3] == "0.5x |"
    assert lines["adamw_lr5e-4_s1"][1] == "-16.7%"
    for bad in ("k8_ef_s1=nope_s1:250", "k8_ef_s1=k8_s1", "k8_s2=k8_s1:250"):  # no such run, no bytes, a taken name
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plot.py"), "--frontier",
                            str(tmp_path / "runs.csv"), "--same-bits", bad, "--out", str(tmp_path / "out")],
                           capture_output=True, text=True)
        assert r.returncode == 2 and f"--same-bits {bad}: takes NAME=RUN:BYTES" in r.stderr, r.stderr


def _elastic_log(path, steps, seconds, tps, participants=None, extra=()):
    """Replica logs for elastic_outage.report: step s ends at sum(seconds(1..s)); 8,192 tokens a step."""
    lines, t = [], 0.0
    for s in steps:
        t += seconds(s)
        lines.append(_line(t, f"step: {s:4d}  loss:  5.0  grad_norm:  1.0  memory:  1.00GiB(1.00%)  "
                              f"tps: {tps(s):,.0f}  tflops: 0.1  mfu: 0.01%"))
        if participants:
            n = participants(s)
            lines.append(_line(t, f"flexdemo step: {s}  sent_bytes: 100  received_bytes: {100 * (n - 1)}  "
                                  f"sent_bytes_total: {100 * s}  received_bytes_total: {100 * s}  optimizer_step_ms: 1.0"))
    lines += [_line(t + 0.1, x) for x in extra]
    path.write_text("\n".join(lines) + "\n")
    return t


def test_elastic_outage_puts_the_stall_at_the_kill_in_during(tmp_path):
    """Replica 1 of 4 killed after it logged step 100; replica 0's step 102 waits 15.2 s for it (the
    process group's timeout) and still counts 4 replicas; from 103 on, 3. The stall belongs to
    "during" and is reported as step 102, 15.2 s: the old windowing (split at K = 103) put it in
    "before" (a quarter of the uninterrupted speed there) and reported a 0.1 s step after K."""
    import elastic_outage

    work = tmp_path / "runs"
    (work / "outage").mkdir(parents=True)
    (work / "uninterrupted").mkdir()
    N, H, R = 300, 200, 4
    normal = 0.1  # s per step: 81,920 tokens/s

    def sec(s):
        return 15.2 if s == 102 else normal

    def tps(s):
        return 8192 / sec(s)

    def parts(s):
        return R if s < 103 or s >= H else R - 1

    digest = [f"flexdemo: replica check at step {s}: 4 replicas identical (local param digest abc{s})"
              for s in (250, 300)]
    end = _elastic_log(work / "outage" / "replica0.log", range(1, N + 1), sec, tps, parts, digest)
    _elastic_log(work / "outage" / "replica1.log", range(1, 101), lambda s: normal, lambda s: 81920)
    _elastic_log(work / "outage" / "replica1_restarted.log", [], lambda s: normal, lambda s: 81920,
                 extra=[f"flexdemo: elastic replica healed from a live peer at step {H}", *digest])
    for r in (2, 3):
        _elastic_log(work / "outage" / f"replica{r}.log", [], lambda s: normal, tps, extra=digest)
    for r in range(R):
        _elastic_log(work / "uninterrupted" / f"replica{r}.log", range(1, N + 1), lambda s: normal,
                     lambda s: 81920, lambda s: R, digest)
    killed = (T0 + timedelta(seconds=100 * normal + 0.05)).timestamp()  # during step 101, on the same clock
    args = argparse.Namespace(replicas=R, victim=1, min_replicas=3, steps=N, kill_at=100, restart_at=150,
                              warmup=50, margin=10, common="", work=work, config=REPO / "x.toml",
                              reference_config=REPO / "y.toml")
    seen = {"outage": {"kind": "outage", "events": {"killed_unix": killed}, "exit_codes": {}},
            "uninterrupted": {"kind": "uninterrupted", "events": {}, "exit_codes": {}}}
    res, lines, ok = elastic_outage.report(args, seen)
    assert ok, lines
    assert res["first_step_without"] == 103 and res["first_step_back"] == H
    w = res["windows"]
    assert w["before"]["outage"]["tokens_per_s"] == pytest.approx(81920, rel=1e-3)  # old windowing: 20,986
    assert w["before"]["outage"]["steps"] == [51, 100]
    assert res["kill_split_step"] == 101
    assert res["stall_at_kill"] == {"step": 102, "seconds": 15.2}
    assert w["during"]["outage"]["steps"] == [101, H - 1]
    n = H - 101  # steps 101..199: 98 at 0.1 s and the stall
    assert w["during"]["outage"]["tokens_per_s"] == pytest.approx(8192 * n / (15.2 + (n - 1) * normal), rel=1e-3)
    assert res["outage_wall_s"] == pytest.approx(15.2 + (H - 101) * normal, abs=0.1)
    assert any("step 102: 15.20 s" in x for x in lines)
    assert end > 0
    # without the kill's time the victim's last logged step still splits: 101
    seen["outage"]["events"] = {}
    assert elastic_outage.report(args, seen)[0]["kill_split_step"] == 101


def test_extract_appends_a_batch_and_refuses_a_run_twice(results, tmp_path):
    # A comparison's CSV grows a batch at a time: --append adds the new logs' rows under the same
    # columns; a run already there is refused (its rows twice would leave which is the run unknown),
    # or with --replace its old rows go first (a killed run rerun); --append needs --extract.
    plot_py = [sys.executable, str(REPO / "benchmarks" / "plot.py")]
    csv_path = tmp_path / "runs.csv"
    first = subprocess.run(plot_py + ["--extract", str(csv_path), f"flexdemo={tmp_path / 'flexdemo.log'}"],
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = csv_path.read_text()
    add = plot_py + ["--extract", str(csv_path), "--append", f"demo_diloco={tmp_path / 'demo_diloco.log'}"]
    assert subprocess.run(add, capture_output=True, text=True).returncode == 0
    both = plot.read_csv(csv_path)
    assert list(both) == ["flexdemo", "demo_diloco"] and csv_path.read_text().startswith(before)
    assert both["demo_diloco"].validation == titan_logs.parse(tmp_path / "demo_diloco.log").validation
    again = subprocess.run(add, capture_output=True, text=True)
    assert again.returncode == 1 and "runs already in" in again.stderr and "demo_diloco" in again.stderr
    assert plot.read_csv(csv_path)["demo_diloco"].validation == both["demo_diloco"].validation
    # a rerun under the same name: the flexdemo log's rows replace demo_diloco's
    rerun = subprocess.run(plot_py + ["--extract", str(csv_path), "--append", "--replace",
                                      f"demo_diloco={tmp_path / 'flexdemo.log'}"], capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    replaced = plot.read_csv(csv_path)
    assert list(replaced) == ["flexdemo", "demo_diloco"]
    assert replaced["demo_diloco"].validation == replaced["flexdemo"].validation == {10: 4.9, 20: 4.5}
    alone = subprocess.run(plot_py + ["--csv", str(csv_path), "--append"], capture_output=True, text=True)
    assert alone.returncode == 2 and "--append goes with --extract" in alone.stderr
