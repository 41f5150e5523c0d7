"""The planner (python -m flexdemo.plan): bytes against the wire format written out independently,
predictions against the shaped-link runs on the results page, the README's table, bad input."""

import dataclasses
import functools
import sys
import tomllib

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

from torchtitan.config import ConfigManager

from flexdemo.plan import __main__ as cli
from flexdemo.plan import readme
from flexdemo.plan.choose import recommend
from flexdemo.plan.evidence import LossCost
from flexdemo.plan.model import PRESETS, Cluster, Row, Variant, compressed_traffic, local_shapes, plan_rows
from flexdemo.titan import memory
from flexdemo.titan.config import FlexDemo, validate_job_config
from titan_launch import CONFIGS, REPO, cpu_model_local_shapes, expected_payload_bytes

sys.path.insert(0, str(REPO / "benchmarks"))
import plan_check  # noqa: E402


def _config(name: str, *overrides: str):
    return ConfigManager().parse_args(["--job.config_file", str(CONFIGS / name), *overrides])


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_fsdp_shards_are_torch_chunks_of_the_real_model(shards):
    params = memory.shapes_of(_config("cpu_2x2_flexdemo.toml")).params
    assert local_shapes(params, shards, 1) == cpu_model_local_shapes(0, shards)


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("encoding", ["sign", "two_bit"])
def test_allgather_bytes_are_the_reference_wire_format(world, encoding):
    params = memory.shapes_of(_config("cpu_2x2_flexdemo.toml")).params
    got = compressed_traffic(local_shapes(params, 2, 1), 64, 32, encoding, "fixed", "dct", "allgather", 0, world)
    assert got == (world - 1) * expected_payload_bytes(0, encoding)


def test_tensor_parallel_shards_follow_torchtitans_plan():
    params = [("layers.0.attention.wq.weight", (512, 256)), ("layers.0.attention.wo.weight", (256, 512)),
              ("layers.0.feed_forward.w2.weight", (256, 768)), ("layers.0.attention_norm.weight", (256,)),
              ("tok_embeddings.weight", (1000, 256))]
    assert local_shapes(params, 3, 4) == [(43, 256), (86, 128), (86, 192), (86,), (84, 256)]


def test_predictions_are_within_20_percent_of_the_shaped_link_runs():
    rows = plan_check.checks() + plan_check.prior_checks()
    assert {(r.folder, r.method) for r in rows} >= {("link_4node_1gbit", m) for m in
                                                   ("adamw", "flexdemo", "flexdemo_sharded", "diloco", "demo_diloco")}
    # the run measured after its prediction was committed (72e0eaa), with the planner's H200 compute step
    assert {(r.folder, r.method) for r in rows} >= {("link_2node_200mbit (predicted first)", m)
                                                   for m in ("flexdemo", "diloco")}
    for r in rows:
        assert abs(r.error) <= plan_check.TOLERANCE, plan_check.markdown([r])
        # the payload formulas changed since (wire format 5; the 1B flavor's sizes): bytes within 2%
        assert abs(r.predicted_bytes / r.measured_bytes - 1) < 0.02, plan_check.markdown([r])
    # docs/planner.md shows this table as the script prints it today (python3 benchmarks/plan_check.py --write)
    assert plan_check.page_block(plan_check.PAGE.read_text()) == plan_check.markdown(rows)


def _row(mode, seconds, fits, seeds=None, corpus=2):
    loss = None if seeds is None else LossCost(mode, {}, tuple(seeds), "test", corpus=corpus)
    return Row(Variant(mode), "-", {}, 0.0, 0.0, seconds, 1.0, 0, fits, loss)


TIGHT = (-0.011, -0.012, -0.010, -0.011)  # 95% interval about [-1.2%, -1.0%]


def test_recommendation_skips_what_does_not_fit_or_costs_loss():
    fast_no_fit = _row("demo", 0.1, False, seeds=TIGHT)
    fast_lossy = _row("demo", 0.1, True, seeds=(0.11, 0.24))  # sharded at W = 4
    ok = _row("demo_diloco", 0.3, True, seeds=(-0.010, -0.011, -0.009))
    adamw = _row("off", 1.0, True)
    best, why = recommend([adamw, fast_no_fit, fast_lossy, ok])
    assert best is ok and "AdamW-HSDP's 1.000" in why
    best, why = recommend([_row("off", 0.30, True), _row("demo", 0.296, True, seeds=TIGHT)])
    assert best.variant.mode == "demo"  # as fast (within 2%) and a lower loss
    best, why = recommend([_row("off", 1.0, False), fast_no_fit])
    assert best is None and "fits" in why


@pytest.mark.parametrize("seeds, corpus", [
    ((-0.05,), 2),                      # one seed: no interval
    ((-0.05, 0.005), 2),                # every seed within +1%, the interval's upper end far above
    ((-0.041, -0.053, -0.06), 1),       # a tight interval on corpus version 1
])
def test_the_loss_rule_is_the_intervals_upper_end_on_the_comparison_corpus(seeds, corpus):
    best, _ = recommend([_row("off", 1.0, True), _row("demo", 0.1, True, seeds=seeds, corpus=corpus)])
    assert best.variant.mode == "off"
    best, _ = recommend([_row("off", 1.0, True), _row("demo", 0.1, True, seeds=TIGHT)])
    assert best.variant.mode == "demo"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_are_the_shipped_configs(preset):
    section = tomllib.loads((CONFIGS / preset).read_text())["flexdemo"]
    v = PRESETS[preset]
    assert section["mode"] == v.mode
    defaults = FlexDemo()
    for key, value in v.keys:
        assert section.get(key, getattr(defaults, key)) == value, key


def test_cli_prints_every_mode_and_one_recommendation(capsys):
    lines = cli.main([str(CONFIGS / "multinode_llama3_1b_flexdemo.toml"), "--nodes", "4", "--link-gbit", "0.3",
                      "--gpu", "H200", "--rtt-ms", "20"])
    rows = [x for x in lines if x.startswith("mode=")]
    assert {x.split()[0] for x in rows} == {"mode=off", "mode=demo", "mode=diloco", "mode=demo_diloco"}
    assert {x.split()[1] for x in rows} >= {"exchange=-", "exchange=allgather", "exchange=sharded", "exchange=dense"}
    for x in rows:
        for field in ("bytes_per_rank_per_step=", "seconds_per_step=", "tokens_per_s_per_gpu=", "memory_per_gpu_gib="):
            assert field in x
    rec = [x for x in lines if x.startswith("recommended: ")]
    assert len(rec) == 1 and " because " in rec[0]
    # the command it names is a valid config for that cluster
    command = rec[0].split(" (", 1)[1].split("; the keys of", 1)[0].split(") because", 1)[0].split()
    jc = ConfigManager().parse_args(["--job.config_file", *command, "--parallelism.data_parallel_replicate_degree", "4"])
    validate_job_config(jc, 32)
    assert capsys.readouterr().out.strip().splitlines() == lines


def test_the_recommendation_fits_where_faster_modes_do_not():
    jc = _config("multinode_llama3_70b_flexdemo.toml")
    from flexdemo.plan.compute import compute_step
    from flexdemo.plan.evidence import GPU_MEMORY

    rows, _ = plan_rows(jc, Cluster(2, 10.0, 0.0, 8, compute_step(jc, "H200").seconds, GPU_MEMORY["H200"], "H200"))
    # as if every mode's loss met the rule: only memory decides
    rows = [r if r.variant.mode == "off" else dataclasses.replace(r, loss=LossCost(r.variant.mode, {}, TIGHT, "test",
                                                                                      corpus=2)) for r in rows]
    best, _ = recommend(rows)
    # the DiLoCo modes keep AdamW's 8 bytes of state per parameter: faster here, and out of memory
    assert any(r.fits is False and r.seconds_per_step < best.seconds_per_step for r in rows)
    assert best.fits


@pytest.mark.parametrize("args, says", [
    (["--nodes", "1", "--link-gbit", "1", "--gpu", "H200"], "--nodes must be >= 2"),
    (["--nodes", "4", "--link-gbit", "0", "--gpu", "H200"], "--link-gbit must be > 0"),
    (["--nodes", "4", "--link-gbit", "1", "--gpu", "A100"], "unknown --gpu 'A100'"),
    (["--nodes", "4", "--link-gbit", "1", "--step-seconds", "-1"], "--step-seconds must be > 0"),
    (["no_such.toml", "--nodes", "4", "--link-gbit", "1", "--gpu", "H200"], "no config file no_such.toml"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, says, capsys):
    args = list(args)
    config = args.pop(0) if args[0].endswith(".toml") else str(CONFIGS / "multinode_llama3_1b_flexdemo.toml")
    with pytest.raises(SystemExit) as e:
        cli.main([config, *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_a_config_that_fits_nowhere_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([str(CONFIGS / "multinode_llama3_70b_flexdemo.toml"), "--nodes", "2", "--link-gbit", "1",
                  "--gpu", "H100"])
    assert e.value.code == 2
    assert "no mode fits H100" in capsys.readouterr().err


def test_the_readme_table_is_the_planners():
    assert readme.current((REPO / "README.md").read_text()) == readme.table(REPO)


def test_a_setting_measured_on_both_corpora_is_costed_by_the_comparison_corpus(monkeypatch):
    from flexdemo.plan import evidence

    settings = {"sync_interval": 30, "outer_topk": 64, "outer_lr": 3.0}
    old = LossCost("demo_diloco", settings, (-0.11, -0.05), "version 1")
    new = LossCost("demo_diloco", settings, (0.004, 0.006, 0.005, 0.007), "version 2",
                   corpus=evidence.COMPARISON_CORPUS)
    keys = {**settings, "exchange": "allgather"}
    monkeypatch.setattr(evidence, "LOSS_COSTS", (old,))
    assert evidence.loss_cost("demo_diloco", keys) is old and not old.within(evidence.LOSS_TOLERANCE)
    monkeypatch.setattr(evidence, "LOSS_COSTS", (old, new))
    assert evidence.loss_cost("demo_diloco", keys) is new and new.within(evidence.LOSS_TOLERANCE)
    assert evidence.loss_cost("diloco", keys) is None


def test_the_long_runs_loss_costs_are_their_data():
    """Every cited cost that names its runs is recomputed from that folder's runs.csv (final held-out
    losses, the run against AdamW on the same seed), and SparseLoCo's settings are its preset's.
    The finals are paired_seeds.py's: a folder whose runs stopped at different steps (a killed run's
    last loss is no final) or read other data than their baseline cannot be cited."""
    import paired_seeds

    from flexdemo.plan.evidence import LOSS_COSTS

    @functools.cache
    def final(folder):
        return paired_seeds.finals(REPO / "docs" / "results" / folder / "runs.csv")

    @functools.cache
    def data(folder):
        return paired_seeds.data_read(REPO / "docs" / "results" / folder / "runs.csv")

    cited = [c for c in LOSS_COSTS if c.runs]
    assert len(cited) >= 2 and all(len(c.runs) == len(c.vs_adamw) for c in cited)
    for cost in cited:
        runs = [run.split("/") for run in cost.runs]
        pairs = [(folder, run, "adamw_s" + run.rsplit("_s", 1)[1]) for folder, run in runs]
        got = tuple(round(final(folder)[run] / final(folder)[adamw] - 1, 3) for folder, run, adamw in pairs)
        assert cost.vs_adamw == got, cost
        for folder, run, adamw in pairs:
            paired_seeds.check_same_data(data(folder), [run, adamw])
    # The shipped preset a run's name stands for, with the flags it names (sparseloco_olr2_*:
    # --flexdemo.outer_lr 2.0 on gpu_2gpu_sparseloco.toml; _top48: and --flexdemo.outer_topk 48;
    # docs/results/*/meta.json). The headline's settings have presets of their own, no flags.
    shipped = {"demo_diloco_h30": ("gpu_2gpu_demo_diloco_h30.toml", {}),
               "sparseloco": ("gpu_2gpu_sparseloco.toml", {}),
               "sparseloco_olr2": ("gpu_2gpu_sparseloco.toml", {"outer_lr": 2.0}),
               "sparseloco_olr2_top48": ("gpu_2gpu_sparseloco.toml", {"outer_lr": 2.0, "outer_topk": 48}),
               "sparseloco_olr3": ("gpu_2gpu_sparseloco_outer_lr3.toml", {}),
               "sparseloco_olr3_h16_top32": ("gpu_2gpu_sparseloco_h16_top32.toml", {}),
               "top16": ("gpu_2gpu_flexdemo_top16.toml", {})}
    defaults = dataclasses.asdict(FlexDemo())  # a key a preset leaves out takes [flexdemo]'s default
    for cost in cited:
        config, flags = shipped[cost.runs[0].split("/")[1].rsplit("_s", 1)[0]]
        preset = {**defaults, **tomllib.loads((CONFIGS / config).read_text())["flexdemo"], **flags}
        assert set(cost.settings) <= set(preset), cost  # every key a [flexdemo] key
        assert {k: v for k, v in cost.settings.items() if k in preset} == \
            {k: preset[k] for k in cost.settings if k in preset}, cost
