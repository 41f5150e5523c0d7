import torch
import torch.distributed as dist

from flexdemo import ReplicaMismatchError, check_replicas_identical
from flexdemo.replica_check import tensor_hash
from multiproc import run_ranks


def test_hash_sees_single_bit_and_position_changes():
    x = torch.randn(1000)
    y = x.clone()
    y.view(torch.int32)[500] ^= 1  # flip the lowest mantissa bit
    assert tensor_hash(x) != tensor_hash(y)
    assert tensor_hash(x) != tensor_hash(x.flip(0))
    assert tensor_hash(x) == tensor_hash(x.clone())
    assert tensor_hash(torch.zeros(3)) != tensor_hash(torch.zeros(4))
    assert tensor_hash(-torch.zeros(3)) != tensor_hash(torch.zeros(3))  # bits, not values
    b = torch.randn(64, dtype=torch.float64).to(torch.bfloat16)
    assert tensor_hash(b) == tensor_hash(b.clone())


def _check(rank, world, bad_rank, bad_index):
    named = [(f"layer{i}.weight", torch.arange(10.0) * i) for i in range(4)]
    if rank == bad_rank:
        named[bad_index][1][3] += 1e-6
    try:
        check_replicas_identical(named)
    except ReplicaMismatchError as e:
        return e.name, e.ranks, str(e)
    return None


def test_identical_replicas_pass():
    assert run_ranks(_check, 2, -1, 0) == [None, None]


def test_first_differing_parameter_is_named_on_every_rank():
    results = run_ranks(_check, 4, 2, 1)
    for name, ranks, msg in results:
        assert name == "layer1.weight"
        assert ranks == [0, 2]
        assert "layer1.weight" in msg


def _resync(rank, world, action):
    import torch.nn as nn

    from flexdemo.titan.replicas import ReplicaSyncError, verify_or_resync

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    shared = torch.full((3,), float(rank))  # e.g. a DiLoCo global copy that drifted too
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1.0
    try:
        resynced = verify_or_resync([model], None, step=7, action=action, shared_state=[shared])
    except ReplicaSyncError as e:
        return "stopped", str(e)
    flat = torch.cat([model.weight.detach().reshape(-1), model.bias.detach(), shared])
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return resynced, all(torch.equal(o, out[0]) for o in out) and torch.equal(shared, torch.zeros(3))


def test_replicas_found_different_are_resynced_from_replica0():
    assert run_ranks(_resync, 2, "resync") == [(True, True), (True, True)]
    for verdict, message in run_ranks(_resync, 2, "stop"):
        assert verdict == "stopped" and "'weight' differs" in message
