"""Every shipped config (train_configs/*.toml) through torchtitan 0.3.0's TOML reader
(flexdemo.titan.v0_3.toml_config): each builds a FlexTrainer.Config, or is refused with one line
naming the key (REFUSED: none today). flexdemo's extra model flavors are 0.2.2's sizes, [validation]
local_batch_size / seq_len reach the validator's loader, a non-flexdemo dataset is torchtitan's
text loader, and [optimizer] keys a mode does not read are named as on 0.2.2.

Skipped unless torchtitan 0.3.x is installed, e.g.:
    PYTHONPATH=. /work/venv030/bin/python -m pytest tests/test_torchtitan_0_3_configs.py
"""

from pathlib import Path

import pytest

from torchtitan_version import needs_torchtitan_0_3

pytestmark = needs_torchtitan_0_3

CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"
REFUSED: dict[str, str] = {}  # config -> the key its one-line refusal names
# Parameters of flexdemo's flavors on 0.2.2 (flexdemo.titan.spec), counted there on the meta device.
PARAMS_022 = {("flexdemo_llama3", "debugmodel_2layer"): 2753792, ("flexdemo_llama3", "small"): 78662400,
              ("flexdemo_llama3", "1B"): 981534720, ("flexdemo_qwen3", "debugmodel_untied"): 32512256,
              ("flexdemo_qwen3", "0.6B_untied"): 751632384}


def read(path, *overrides):
    from flexdemo.titan.v0_3.toml_config import read

    return read(str(path), list(overrides))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_config_reads(path):
    from flexdemo.section import FlexDemoConfigError
    from flexdemo.titan.v0_3.trainer import FlexTrainer

    try:
        c = read(path)
    except FlexDemoConfigError as e:
        assert path.stem in REFUSED and REFUSED[path.stem] in str(e) and "\n" not in str(e), str(e)
        return
    assert path.stem not in REFUSED
    assert isinstance(c, FlexTrainer.Config)
    import tomllib

    t = tomllib.loads(path.read_text())
    assert c.model_spec.flavor == t["model"]["flavor"] and c.training.steps == t["training"]["steps"]


@pytest.mark.parametrize("name, flavor", sorted(PARAMS_022))
def test_extra_flavors_are_0_2_2s(name, flavor):
    import torch

    from flexdemo.titan.v0_3.model import model_spec

    spec = model_spec(name, flavor)
    with torch.device("meta"):
        model = spec.model.build()
    assert sum(p.numel() for p in model.parameters()) == PARAMS_022[(name, flavor)]
    assert not getattr(spec.model, "enable_weight_tying", False)


def test_stock_flavor_stays_stock_under_the_family_name():
    from flexdemo.titan.v0_3.model import model_spec

    assert model_spec("llama3", "1B").model.vocab_size == 128256  # torchtitan's own 1B
    assert model_spec("flexdemo_llama3", "1B").model.vocab_size == 2048  # flexdemo's, as on 0.2.2


def test_validation_batch_and_sequence_reach_the_loader():
    from flexdemo.section import FlexDemoConfigError

    c = read(CONFIGS / "cpu_2x2_flexdemo.toml", "--validation.enable", "--validation.seq_len", "64",
             "--validation.local_batch_size", "3")
    loader = c.validator.dataloader
    assert (loader.validation_seq_len, loader.validation_local_batch_size) == (64, 3) and c.training.seq_len == 128
    same = read(CONFIGS / "cpu_2x2_flexdemo.toml", "--validation.enable", "--validation.seq_len", "128")
    assert (same.validator.dataloader.validation_seq_len, same.validator.dataloader.validation_local_batch_size) == (0, 0)
    with pytest.raises(FlexDemoConfigError, match=r"^\[validation\] seq_len = 64: with pipeline parallelism"):
        read(CONFIGS / "cpu_2x2_flexdemo.toml", "--validation.enable", "--validation.seq_len", "64",
             "--parallelism.pipeline_parallel_degree", "2")


@pytest.mark.parametrize("dataset", ["flexdemo_stdlib_validation", "plain_text_validation"])
def test_validation_loaders_build_as_torchtitans_validator_builds_them(assets, dataset, monkeypatch):
    # 0.3.0's Validator builds its loader at every validation with the training's seq_len and local
    # batch size as build() kwargs; Configurable.build refuses a Config field of either name (loaders
    # that had one failed at the first validation). [validation] seq_len / local_batch_size still win.
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as tt_text

    from flexdemo.data import load_corpus
    from flexdemo.data.tokenizer import FileTokenizer

    monkeypatch.setitem(tt_text.DATASETS, "plain_text_validation", DatasetConfig(
        path=str(assets), loader=lambda path: Dataset.from_dict({"text": load_corpus(path)["validation"]}),
        sample_processor=lambda s: s["text"]))
    c = read(CONFIGS / "cpu_2x2_flexdemo.toml", "--validation.enable", "--validation.dataset", dataset,
             "--validation.dataset_path", str(assets), "--validation.steps", "2", "--validation.seq_len", "64",
             "--validation.local_batch_size", "4")
    assert (c.training.seq_len, c.training.local_batch_size) == (128, 2)  # what the Validator passes
    loader = c.validator.dataloader.build(dp_world_size=2, dp_rank=1, tokenizer=FileTokenizer(str(assets)),
                                          seq_len=c.training.seq_len, local_batch_size=c.training.local_batch_size)
    inputs, labels = next(iter(loader))
    assert inputs["input"].shape == labels.shape == (4, 64)


def test_text_dataset_is_torchtitans_and_a_missing_tokenizer_refused_at_launch():
    from flexdemo.section import FlexDemoConfigError
    from flexdemo.titan.v0_3.data import TextDataLoader
    from flexdemo.titan.v0_3.settings import validate

    c = read(CONFIGS / "multinode_llama3_8b_flexdemo.toml", "--model.hf_assets_path", "/nonexistent/tok")
    assert isinstance(c.dataloader, TextDataLoader.Config) and c.dataloader.dataset == "c4"
    assert isinstance(c.validator.dataloader, TextDataLoader.Config) and c.validator.dataloader.dataset == "c4_validation"
    with pytest.raises(FlexDemoConfigError, match="hf_assets_path '/nonexistent/tok' holds no tokenizer") as e:
        validate(c, 16)
    assert "\n" not in str(e.value)


def test_optimizer_keys_demo_does_not_read_are_named():
    from flexdemo.titan.v0_3.optimizer import ignored_keys

    c = read(CONFIGS / "cpu_2x2_flexdemo.toml", "--optimizer.eps", "1e-6", "--optimizer.name", "Adam",
             "--optimizer.implementation", "foreach", "--flexdemo.outer_lr", "0.5")
    assert ignored_keys(c.flexdemo, c.optimizer) == [
        "flexdemo.outer_lr", "optimizer.name", "optimizer.eps", "optimizer.implementation"]
    assert ignored_keys(read(CONFIGS / "cpu_2x2_flexdemo.toml").flexdemo, read(CONFIGS / "cpu_2x2_flexdemo.toml").optimizer) == []
    off = read(CONFIGS / "cpu_2x2_hsdp_adamw.toml", "--optimizer.eps", "1e-6")
    assert ignored_keys(off.flexdemo, off.optimizer) == []  # AdamW reads them all


def test_training_loader_checks_that_every_rank_reads_the_same_data(assets, monkeypatch):
    # as 0.2.2's loader: ranks of other corpus builds or tokenizers stop before training
    # (flexdemo.data.same_data; its refusal over gloo: tests/test_data.py)
    from flexdemo.data.tokenizer import FileTokenizer
    from flexdemo.titan.v0_3 import data

    seen = []
    monkeypatch.setattr(data, "check_same_data_on_all_ranks", lambda *args: seen.append(args))
    c = read(CONFIGS / "cpu_2x2_flexdemo.toml", "--training.dataset_path", str(assets))
    tok = FileTokenizer(str(assets))
    c.dataloader.build(dp_world_size=2, dp_rank=1, tokenizer=tok, seq_len=64, local_batch_size=2)
    assert seen == [(str(assets), tok, "flexdemo_stdlib")]
