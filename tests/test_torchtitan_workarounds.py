"""flexdemo.titan.torchtitan_workarounds against the installed torchtitan: the version they were
written for, the ParallelDims members the views override, and what each view reports (meshes
built on a fake process group of 4 ranks: no real communication)."""

import importlib.metadata
import inspect

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

import torch.distributed as dist
import torch.nn as nn
from torchtitan.distributed import ParallelDims

from flexdemo.titan import torchtitan_workarounds as tw

VIEWS = (tw.ShardOnlyDims, tw.ReplicaLocalBatch)


def _dims(replicas: int, shards: int) -> ParallelDims:
    return ParallelDims(dp_replicate=replicas, dp_shard=shards, cp=1, tp=1, pp=1, ep=1, etp=1,
                        world_size=replicas * shards)


@pytest.fixture
def fake_world(monkeypatch):
    """A process group of 4 fake ranks (this process is rank 0), so ParallelDims builds its meshes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torchtitan.distributed.parallel_dims as parallel_dims_module

    assert not dist.is_initialized()
    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")  # "cuda" on a CPU box, see NOTES
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_installed_torchtitan_is_the_version_written_against():
    installed = importlib.metadata.version("torchtitan")
    assert installed == tw.TORCHTITAN_VERSION, (
        f"torchtitan {installed} is installed, flexdemo/titan/torchtitan_workarounds.py was written against "
        f"{tw.TORCHTITAN_VERSION}: re-check each workaround listed in its docstring (does the new version offer "
        "the extension point named there? do the ParallelDims members the views override still mean the same? "
        "does build_optimizers still build the same Adam kwargs? is init_weights still called after "
        "parallelize_fn?), then update TORCHTITAN_VERSION"
    )


@pytest.mark.parametrize("view", VIEWS, ids=lambda v: v.__name__)
def test_overridden_members_still_exist_with_the_same_kind(view):
    overridden = [n for n in vars(view) if not n.startswith("__")]
    assert overridden
    for name in overridden:
        assert hasattr(ParallelDims, name), f"ParallelDims.{name} is gone: {view.__name__} overrides nothing"
        upstream, ours = inspect.getattr_static(ParallelDims, name), inspect.getattr_static(view, name)
        assert type(upstream) is type(ours), (
            f"ParallelDims.{name} is a {type(upstream).__name__}, {view.__name__}.{name} a {type(ours).__name__}"
        )


def test_shard_only_view_hides_the_replicas_from_fsdp(fake_world):
    dims = _dims(replicas=2, shards=2)
    view = tw.shard_only_view(dims)
    assert dims.dp_replicate_enabled and dims.fsdp_gradient_divide_factor == 4  # the stock view
    assert isinstance(view, ParallelDims)
    assert not view.dp_replicate_enabled
    assert view.fsdp_enabled and view.fsdp_gradient_divide_factor == 2  # the shard degree
    # The same meshes, not new ones: FSDP shards over this run's fsdp mesh.
    assert view.get_mesh("fsdp") is dims.get_mesh("fsdp") and view.get_mesh("fsdp").size() == 2
    assert (view.dp_replicate, view.dp_shard, view.world_size) == (2, 2, 4)


def test_replica_local_view_batches_inside_a_replica(fake_world):
    dims = _dims(replicas=2, shards=2)
    dims.build_mesh()
    view = tw.replica_local_batch_view(dims)
    assert view.dp_enabled and view.dp_cp_enabled
    assert dims.get_mesh("batch").size() == 4
    assert view.get_mesh("batch") is dims.get_mesh("fsdp") and view.get_mesh("batch").size() == 2
    assert view.get_mesh("dp_replicate") is dims.get_mesh("dp_replicate")  # other meshes untouched


def test_replica_local_view_of_one_shard_per_replica():
    dims = _dims(replicas=2, shards=1)  # properties only: no mesh, no process group
    view = tw.replica_local_batch_view(dims)
    assert dims.dp_enabled and not view.dp_enabled  # no token count to all-reduce inside a replica
    assert view.dp_cp_enabled  # the logged loss is still summed over every data-parallel rank


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.inits = 0

    def init_weights(self, buffer_device=None):
        self.inits += 1


def test_after_init_weights_runs_once_after_the_models_own():
    model, seen = _Model(), []
    tw.after_init_weights(model, lambda: seen.append(model.inits))
    model.init_weights(buffer_device=None)
    assert seen == [1]  # after the model's own init_weights
    model.init_weights()
    assert seen == [1] and model.inits == 2  # once; then the class's method again


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
def test_adam_kwargs_match_torchtitans_build_optimizers(name, implementation):
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config.job_config import Optimizer

    config = Optimizer(name=name, lr=3e-4, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.05,
                       implementation=implementation)
    stock = build_optimizers([nn.Linear(4, 4)], config, _dims(1, 1)).optimizers[0]
    cls, kwargs = tw.adam_class_and_kwargs(config, "diloco")
    assert type(stock) is cls
    assert {k: stock.defaults[k] for k in kwargs} == kwargs


def test_adam_kwargs_refuse_other_optimizers():
    from torchtitan.config.job_config import Optimizer

    from flexdemo.titan.config import FlexDemoConfigError

    with pytest.raises(FlexDemoConfigError, match=r"mode='diloco' supports optimizer.name in \['Adam', 'AdamW'\]"):
        tw.adam_class_and_kwargs(Optimizer(name="SGD"), "diloco")


def test_the_trainer_parallelizes_before_it_builds_the_optimizers_from_the_optimizer_section():
    # with_job_config relies on both: parallelize_fn (or pipelining_fn, which calls it) sees the
    # job config first, build_optimizers_fn is then handed job_config.optimizer only.
    from torchtitan.train import Trainer

    src = inspect.getsource(Trainer.__init__)
    first = min(src.index("parallelize_fn("), src.index("pipelining_fn("))
    build = src.index("build_optimizers_fn(")
    assert first < build
    assert src[build:build + 120].split(")")[0].split("(")[1].split() == [
        "self.model_parts,", "job_config.optimizer,", "parallel_dims"]


def test_with_job_config_hands_the_builder_what_parallelize_saw():
    seen = []
    parallelize, build = tw.with_job_config(lambda model, dims, job, *a, **k: model,
                                            lambda parts, dims, job: seen.append((parts, dims, job)))
    with pytest.raises(tw.FlexDemoConfigError, match="needs a model parallelized by a flexdemo train spec"):
        build(["part"], "optimizer section", "dims")
    job = object()
    assert parallelize("model", "dims", job) == "model"
    build(["part"], "optimizer section", "dims")
    assert seen == [(["part"], "dims", job)]
