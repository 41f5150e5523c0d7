"""The replicas' start-up agreement (flexdemo.compression.agreement): two replicas that differ in
exactly one setting that changes the decoded bits refuse to start, every rank with the same one
line naming the setting, both values and both ranks; nothing is left waiting in a collective."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from multiproc import run_ranks


def _params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(16, 16, generator=g)), nn.Parameter(torch.randn(32, 8, generator=g))]


def _demo(rank, **differ):
    """A DeMo whose replica 1 takes ``differ`` (DeMo kwargs, or ``topk1``: param 1's group top-k)."""
    from flexdemo import DeMo

    a, b = _params()
    kw = dict(lr=0.1, compression_topk=8)
    topk1 = 8
    if rank == 1:
        topk1 = differ.pop("topk1", topk1)
        kw.update(differ)
    return DeMo([{"params": [a]}, {"params": [b], "compression_topk": topk1}], **kw)


def _diloco(rank, **differ):
    from flexdemo.optim.diloco import DiLoCo

    kw = dict(sync_interval=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression="dense",
              value_encoding="fp32")
    kw.update(differ.pop("both", {}))
    if rank == 1:
        kw.update(differ)
    params = _params()
    sgd = torch.optim.SGD(params, lr=kw.pop("outer_lr"), momentum=kw.pop("outer_momentum"),
                          nesterov=kw.pop("nesterov"))
    return DiLoCo([(str(i), p) for i, p in enumerate(params)], outer_optimizer=sgd, **kw)


def _fused_on_rank1(rank):
    """The fused path can't run on CPU: rank 1 is told its buckets fit the kernels (the decision
    compression.paths takes from fused_supported); the agreement refuses before any kernel runs."""
    import flexdemo.compression.paths as paths

    if rank == 1:
        paths.fused_supported = lambda *args, **kwargs: True
    try:
        return _demo(rank)
    finally:
        import flexdemo.kernels as kernels

        paths.fused_supported = kernels.fused_supported


def _format_on_rank1(rank):
    import flexdemo.wire.format as wire_format

    if rank == 1:
        wire_format.WIRE_FORMAT_VERSION += 1  # this process only
    try:
        return _demo(rank)
    finally:
        if rank == 1:
            wire_format.WIRE_FORMAT_VERSION -= 1


# case -> (build(rank), the setting named, rank 0's value, rank 1's value)
CASES = {
    "decode_path": (_fused_on_rank1, "decode path", "torch", "fused (Triton kernels)"),
    "kernel_precision": (lambda r: _demo(r, kernel_precision="ieee"), "kernel precision", "tf32x3", "ieee"),
    "value_encoding": (lambda r: _demo(r, value_encoding="fp32"), "value encoding", "sign", "fp32"),
    # a 32 x 8 block is 1/16 of 64 x 64: top-8 keeps round(8/16) = 1 there, top-64 keeps 4
    "topk_of_one_parameter": (lambda r: _demo(r, topk1=64), "parameter 1",
                              "local shape (32, 8) float32 in group 1: 1 block of 32x8, top-1",
                              "local shape (32, 8) float32 in group 1: 1 block of 32x8, top-4"),
    "format_version": (_format_on_rank1, "payload format version", None, None),
    "demo_lr": (lambda r: _demo(r, lr=0.2), "param group 0", "lr 0.1, decay 0.999, weight decay 0.0",
                "lr 0.2, decay 0.999, weight decay 0.0"),
    "demo_overlap": (lambda r: _demo(r, overlap=True), "overlap", "False", "True"),
    "diloco_outer_lr": (lambda r: _diloco(r, outer_lr=0.5), "outer lr", "0.7", "0.5"),
    "diloco_sync_interval": (lambda r: _diloco(r, sync_interval=8, both=dict(compression="topk", topk=4)),
                             "sync interval", "4", "8"),
    "diloco_nonfinite": (lambda r: _diloco(r, nonfinite="stop"), "nonfinite", "skip", "stop"),
    "diloco_dense_wire": (lambda r: _diloco(r, value_encoding="bf16"), "outer value encoding", "fp32", "bf16"),
    "diloco_topk_precision": (lambda r: _diloco(r, kernel_precision="ieee", both=dict(compression="topk", topk=4)),
                              "kernel precision", "tf32x3", "ieee"),
    "diloco_transform": (lambda r: _diloco(r, transform="none", both=dict(compression="topk", topk=4)),
                         "transform", "dct", "none"),
}


def _all_cases(rank, world):
    from flexdemo.compression.agreement import ReplicaSettingsMismatch
    from flexdemo.wire.format import WIRE_FORMAT_VERSION

    out = {}
    for name, (build, *_) in CASES.items():
        try:
            build(rank)
            out[name] = None
        except ReplicaSettingsMismatch as e:
            out[name] = (type(e).__name__, str(e), e.setting, e.ranks, e.values)
    # After every refusal the group is still in step: agreeing replicas build and exchange.
    opt = _demo(rank)
    for p in opt.param_groups[0]["params"] + opt.param_groups[1]["params"]:
        p.grad = torch.full_like(p, float(rank + 1))
    opt.step()
    out["exchanged_after"] = opt.compressor.last_traffic.received > 0
    out["format_version"] = (out["format_version"], WIRE_FORMAT_VERSION)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_all_cases, 2, timeout=240)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_differing_setting_is_named_on_every_rank(results, case):
    _, setting, mine, theirs = CASES[case]
    said = [r[case] for r in results]
    if case == "format_version":
        said, version = [s[0] for s in said], results[0][case][1]
        mine, theirs = str(version), str(version + 1)
    assert said[0] is not None, f"{case}: no refusal"
    assert said[0] == said[1], "every rank must raise the same error"
    kind, message, named, ranks, values = said[0]
    assert kind == "ReplicaSettingsMismatch" and "\n" not in message
    assert named == setting and ranks == (0, 1) and values == (mine, theirs), said[0]
    assert f"disagree on {setting}: rank 0 has {mine!r}, rank 1 has {theirs!r};" in message, message


def test_agreeing_replicas_still_exchange_after_refusals(results):
    assert [r["exchanged_after"] for r in results] == [True, True]


def _world_wide(rank, world):
    """2 replicas x 2 shard ranks: replica groups {0, 2} and {1, 3}; only {1, 3} disagrees."""
    from flexdemo.compression.agreement import ReplicaSettingsMismatch, check_settings_agree

    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    settings = {"kernel precision": "ieee" if rank == 3 else "tf32x3"}
    try:
        check_settings_agree("DeMo", settings, groups[rank % 2], torch.device("cpu"))
    except ReplicaSettingsMismatch as e:
        return str(e)
    return None


def test_a_mismatch_in_one_replica_group_stops_every_rank():
    said = run_ranks(_world_wide, 4)
    assert len(set(said)) == 1 and said[0] is not None, said
    assert "disagree on kernel precision: rank 1 has 'tf32x3', rank 3 has 'ieee'" in said[0]


def test_first_difference_names_a_setting_missing_on_one_side():
    from flexdemo.compression.agreement import ABSENT, first_difference

    a = [("x", "1"), ("y", "2")]
    assert first_difference(a, list(a)) is None
    assert first_difference(a, [("x", "1"), ("y", "3")]) == ("y", "2", "3")
    assert first_difference(a, [("x", "1")]) == ("y", "2", ABSENT)
    assert first_difference([("x", "1")], a) == ("y", ABSENT, "2")


def test_a_launched_job_whose_replicas_disagree_exits_with_one_line(tmp_path, assets):
    """Through scripts/launch.sh and torchtitan: 2 replicas x 1 shard, rank 1 with a newer payload
    format (tests/agreement_hook.py): the line once, the ranks' exit code 2 (torchrun's summary;
    torchrun itself exits 1), no rank's traceback, no step."""
    from pathlib import Path

    from titan_launch import CONFIGS, launch

    here = str(Path(__file__).parent)
    run = launch(CONFIGS / "cpu_2x2_flexdemo.toml", tmp_path / "dump", "--parallelism.data_parallel_shard_degree",
                 "1", "--experimental.custom_import", "agreement_hook", assets=assets, timeout=300, nproc=2,
                 env={"PYTHONPATH": here})
    from flexdemo.wire.format import WIRE_FORMAT_VERSION as V

    line = f"flexdemo: DeMo: replicas disagree on payload format version: rank 0 has '{V}', rank 1 has '{V + 1}';"
    assert run.returncode != 0 and run.output.count(line) == 1, run.output[-4000:]
    assert "exitcode  : 2" in run.output, run.output[-4000:]
    assert "ReplicaSettingsMismatch" not in run.output and "agreement.py" not in run.output, run.output[-4000:]
    assert "step:" not in run.output


def _describe_tp_shard(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from flexdemo.compression.agreement import dense_settings

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    params = [distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]), distribute_tensor(torch.zeros(4), mesh, [Replicate()])]
    return dense_settings(params)


def test_the_agreement_names_each_parameters_tensor_parallel_layout():
    """What replicas compare at start covers how TP lays a parameter out, not only its local shape."""
    for settings in run_ranks(_describe_tp_shard, 2):
        assert settings["parameter 0"] == "local shape (4, 3) float32 as (Shard(dim=1)) over tp=2"
        assert settings["parameter 1"] == "local shape (4,) float32 as (Replicate()) over tp=2"
