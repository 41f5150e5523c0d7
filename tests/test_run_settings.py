"""flexdemo.run_settings.RunSettings: the one list of what a run's replicas agree on.

* at start over a fixed group, a replica whose job settings differ stops every rank with one line
  naming the first setting that differs and both values;
* the elastic join list carries every [flexdemo] key, the job keys and the install, nothing
  per-replica (tests/test_titan_elastic.py checks the join refusal itself).
"""

import torch

from flexdemo.compression.agreement import ReplicaSettingsMismatch
from flexdemo.run_settings import RunSettings
from flexdemo.section import FlexDemo
from multiproc import run_ranks


def _agree(rank, world, steps_on_rank1):
    from flexdemo.replica_group import StaticReplicaGroup

    steps = steps_on_rank1 if rank == 1 else 20
    settings = RunSettings(FlexDemo(), job=(("model.flavor", "'debugmodel'"), ("training.steps", repr(steps))))
    try:
        settings.agree(StaticReplicaGroup(), torch.device("cpu"))  # the world
    except ReplicaSettingsMismatch as e:
        return str(e)
    return "agreed"


def test_replicas_with_the_same_settings_agree():
    assert run_ranks(_agree, 2, 20) == ["agreed", "agreed"]


def test_a_replica_with_another_job_setting_stops_every_rank_naming_it():
    said = run_ranks(_agree, 2, 30)
    assert said[0] == said[1], said  # every rank raises the same line
    assert "run settings: replicas disagree on training.steps: rank 0 has '20', rank 1 has '30'" in said[0], said[0]
    assert "\n" not in said[0]


def test_the_items_are_the_section_the_job_and_the_install():
    items = dict(RunSettings(FlexDemo(topk=16), job=(("training.steps", "20"),)).items())
    assert items["flexdemo.topk"] == "16" and items["flexdemo.mode"] == "'demo'"
    assert items["training.steps"] == "20"
    assert items["torch version"] == torch.__version__
    assert "torchtitan version" in items and "flexdemo version" in items
