"""DeMo rejects bad arguments and bad process-group layouts with one clear error."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from flexdemo import DeMo
from multiproc import run_ranks


def _params():
    return [nn.Parameter(torch.randn(4, 4))]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=0.0), "lr must be a positive"),
        (dict(lr=-1.0), "lr must be a positive"),
        (dict(compression_topk=0), "compression_topk must be a positive int"),
        (dict(compression_topk=2.5), "compression_topk must be a positive int"),
        (dict(compression_chunk=0), "compression_chunk must be a positive int"),
        (dict(compression_chunk=-64), "compression_chunk must be a positive int"),
        (dict(compression_decay=1.0), r"compression_decay must be in \[0, 1\)"),
        (dict(compression_decay=-0.1), r"compression_decay must be in \[0, 1\)"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
        (dict(value_encoding="int4"), "unknown value_encoding 'int4'"),
        (dict(kernel_precision="tf32"), "kernel_precision must be one of"),
        (dict(overlap=1), "overlap must be True or False"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(lr=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DeMo(_params(), **args)


def test_bad_per_group_hyperparameter():
    with pytest.raises(ValueError, match="compression_topk"):
        DeMo([{"params": _params(), "compression_topk": -3}], lr=0.1)


def test_single_process_without_distributed_runs():
    p = nn.Parameter(torch.ones(8, 8))
    opt = DeMo([p], lr=0.5, value_encoding="fp32")
    p.grad = torch.ones(8, 8)
    opt.step()
    assert torch.equal(p.detach(), torch.full((8, 8), 0.5))  # sign(+) step of lr
    assert opt.last_step_bytes_received == 0


def _different_shapes(rank, world):
    shape = (8, 8) if rank == 0 else (8, 9)
    try:
        DeMo([nn.Parameter(torch.zeros(shape))], lr=0.1)
    except ValueError as e:
        return str(e)
    return None


def test_replicas_holding_different_shapes_are_rejected():
    for msg in run_ranks(_different_shapes, 2):
        assert msg is not None and "disagree on parameter 0: rank 0 has 'local shape (8, 8) float32" in msg, msg
        assert "rank 1 has 'local shape (8, 9) float32" in msg, msg


def _two_meshes(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fully_shard(a, mesh=mesh["shard"])
    fully_shard(b, mesh=mesh["replicate"])
    errors = []
    try:
        DeMo(list(a.parameters()) + list(b.parameters()), lr=0.1, replicate_group=mesh["replicate"].get_group())
    except ValueError as e:
        errors.append(str(e))
    try:  # the whole world as replicate group overlaps the shard mesh
        DeMo(a.parameters(), lr=0.1, replicate_group=None)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_params_on_different_meshes_and_overlapping_groups_are_rejected():
    for errors in run_ranks(_two_meshes, 4):
        assert len(errors) == 2
        assert "different device meshes" in errors[0]
        assert "overlaps the parameters' mesh" in errors[1]


def test_a_param_group_added_later_joins_the_payload():
    a, b = nn.Parameter(torch.randn(64, 64)), nn.Parameter(torch.randn(128, 64))
    opt = DeMo([a], lr=0.1, compression_topk=8)
    before = opt.payload_bytes_per_step()
    opt.add_param_group({"params": [b], "compression_topk": 16})
    assert opt.payload_bytes_per_step() > before
    for p in (a, b):
        p.grad = torch.ones_like(p)
    start = b.detach().clone()
    opt.step()
    assert opt.last_step_bytes_sent == opt.payload_bytes_per_step() and not torch.equal(b, start)
