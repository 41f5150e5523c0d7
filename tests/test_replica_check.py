import torch

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
