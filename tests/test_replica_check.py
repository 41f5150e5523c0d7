import pytest
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


def _outer_state(rank):
    """A stand-in DiLoCo outer step: one entry whose global copy drifted on rank 1."""
    from types import SimpleNamespace

    glob = torch.full((3,), float(rank == 1))
    return SimpleNamespace(entries=[SimpleNamespace(name="w", global_copy=glob, momentum=torch.zeros(2))])


def _resync(rank, world, action, drift):
    import torch.nn as nn

    from flexdemo.replica_group import StaticReplicaGroup
    from flexdemo.titan.replica_sync import EveryStep, OuterCycle
    from flexdemo.titan.replicas import ReplicaSyncError, verify_or_resync

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    outer = _outer_state(rank) if drift == "global copy" else None
    if rank == 1 and drift == "param":
        with torch.no_grad():
            model.weight[0, 0] += 1.0
    try:
        sync = OuterCycle(outer) if outer is not None else EveryStep([], None, None)
        resynced = verify_or_resync([model], StaticReplicaGroup(), step=7, action=action, sync=sync)  # the world
    except ReplicaSyncError as e:
        return "stopped", str(e)
    shared = outer.entries[0].global_copy if outer is not None else torch.zeros(3)
    flat = torch.cat([model.weight.detach().reshape(-1), model.bias.detach(), shared])
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return resynced, all(torch.equal(o, out[0]) for o in out) and torch.equal(shared, torch.zeros(3))


@pytest.mark.parametrize("drift, named", [("param", "'weight'"), ("global copy", "'global.w'")])
def test_replicas_found_different_are_resynced_from_replica0(drift, named):
    """What is compared: the parameters, or with a DiLoCo outer step its global copy (the one
    set every replica shares, over a fixed group and an elastic one alike)."""
    assert run_ranks(_resync, 2, "resync", drift) == [(True, True), (True, True)]
    for verdict, message in run_ranks(_resync, 2, "stop", drift):
        assert verdict == "stopped" and f"{named} differs" in message


class _QuorumGroup:
    """An elastic-like ReplicaGroup (members are other jobs: it knows only its own world rank)
    over the default process group."""

    membership_fixed = False

    def __init__(self):
        from flexdemo.replica_group import StaticReplicaGroup

        self.inner = StaticReplicaGroup()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def global_ranks(self):
        return [dist.get_rank()]


def _check_quorum(rank, world):
    named = [("a", torch.zeros(4)), ("b", torch.full((4,), float(rank == 2)))]
    try:
        check_replicas_identical(named, _QuorumGroup())
    except ReplicaMismatchError as e:
        return str(e)
    return None


def test_an_elastic_group_takes_the_same_check_naming_quorum_places():
    for msg in run_ranks(_check_quorum, 3):
        assert msg == "replicas diverged: parameter 'b' differs between replicas of this step's quorum [0, 2]; stopping"
