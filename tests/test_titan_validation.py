"""Validation: torchtitan's own Validator, run for real on one CPU process. flexdemo's held-out
splits are read as the same fixed windows at every validation (flexdemo.titan.heldout); for a
dataset of torchtitan's, [flexdemo] validation_same_batches rewinds its loader so that every
validation scores the same batches, where (its stock behaviour, which the key exists for) it
moves on to different ones."""

import contextlib
import hashlib
from pathlib import Path

import pytest

from torchtitan_version import skip_module_unless_torchtitan_0_2

skip_module_unless_torchtitan_0_2()

import torch
from torch import nn

from flexdemo.data.dataset import VALIDATION_DATASET_NAME
from flexdemo.titan.data import register_torchtitan_datasets
from flexdemo.titan.metrics import SameBatchesValidator, wrap_validator_builder

register_torchtitan_datasets()  # torchtitan's validator finds flexdemo's splits by name
# A dataset of torchtitan's own (its loader, not flexdemo's windows): the same text, another name.
TITAN_DATASET = "plain_text_validation"


@pytest.fixture(autouse=True)
def titan_dataset(assets):
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets as tt_text

    from flexdemo.data import load_corpus

    tt_text.DATASETS[TITAN_DATASET] = DatasetConfig(
        path="", loader=lambda path: Dataset.from_dict({"text": load_corpus(assets)["validation"]}),
        sample_processor=lambda s: s["text"])
    yield
    del tt_text.DATASETS[TITAN_DATASET]


def _job_config(assets, same_batches: bool, dataset: str = TITAN_DATASET):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args([
        "--job.custom_config_module", "flexdemo.titan.config",
        "--model.hf_assets_path", str(assets),
        "--validation.enable", "--validation.dataset", dataset,
        "--validation.dataset_path", str(assets),
        "--validation.seq_len", "64", "--validation.local_batch_size", "2", "--validation.steps", "3",
        f"--flexdemo.{'' if same_batches else 'no-'}validation_same_batches",
    ])


class TinyLM(nn.Module):
    """Enough of torchtitan's model protocol for its Validator (causal attention: no masks)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def get_attention_masks(self, *args, **kwargs):
        raise TypeError("no masks")  # what torchtitan's SDPA models do

    def forward(self, tokens):
        return self.out(self.embed(tokens))


class LoggedLosses:
    """The one metrics-processor call the Validator makes."""

    def __init__(self):
        self.losses, self.ntokens_since_last_log = [], 0

    def log_validation(self, loss, step):
        self.losses.append(loss)


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch):
    # The Validator reads torchtitan's device type at call time; a CPU test machine may still
    # have CUDA built in.
    monkeypatch.setattr("torchtitan.tools.utils.device_type", "cpu")


def _validation_losses(assets, same_batches: bool, times: int = 3, dataset: str = TITAN_DATASET) -> list[float]:
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.components.validate import build_validator
    from torchtitan.distributed import ParallelDims

    cfg = _job_config(assets, same_batches, dataset)
    tok = build_hf_tokenizer(cfg)
    torch.manual_seed(0)
    model = TinyLM(tok.get_vocab_size())  # unchanged between validations
    metrics = LoggedLosses()
    validator = wrap_validator_builder(build_validator)(
        job_config=cfg, dp_world_size=1, dp_rank=0, tokenizer=tok,
        parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1),
        loss_fn=lambda pred, labels: nn.functional.cross_entropy(
            pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum"),
        validation_context=contextlib.nullcontext, maybe_enable_amp=contextlib.nullcontext(),
        metrics_processor=metrics,
    )
    assert isinstance(validator, SameBatchesValidator) == same_batches
    for step in range(times):
        validator.validate([model], step)
    return metrics.losses


def test_every_validation_scores_the_same_batches(assets):
    same = _validation_losses(assets, same_batches=True)
    assert len(same) == 3 and same[0] == same[1] == same[2]


def test_flexdemos_held_out_split_is_the_same_windows_without_the_rewind(assets):
    # (validation_same_batches = false is refused for these splits by the config check; the
    # loader alone reads from window 0 at every validation.)
    ours = _validation_losses(assets, same_batches=False, dataset=VALIDATION_DATASET_NAME)
    assert len(ours) == 3 and ours[0] == ours[1] == ours[2]


def test_torchtitans_own_validator_moves_on_to_new_batches(assets):
    # Why the key exists (and a guard that the test above could fail): with the key off, the
    # same model scores a different loss at every validation, and the first equals the key-on one.
    stock = _validation_losses(assets, same_batches=False)
    assert len(set(stock)) == 3
    assert stock[0] == _validation_losses(assets, same_batches=True, times=1)[0]


def test_flexdemo_spec_wraps_the_family_validator(assets):
    import dataclasses

    from torchtitan.models.llama3 import get_train_spec

    from flexdemo.titan.spec import flexdemo_spec

    class Loader:
        def state_dict(self):
            return {}

    class FamilyValidator:
        validation_dataloader = Loader()

    spec = flexdemo_spec(dataclasses.replace(get_train_spec(), build_validator_fn=lambda **kw: FamilyValidator()))
    on = spec.build_validator_fn(job_config=_job_config(assets, True))
    off = spec.build_validator_fn(job_config=_job_config(assets, False))
    assert isinstance(on, SameBatchesValidator) and isinstance(on.inner, FamilyValidator)
    assert isinstance(off, FamilyValidator)


def test_trainer_scores_the_same_batches_on_four_gloo_ranks(tmp_path, assets):
    # Through the launcher and torchtitan's Trainer, HSDP 2x2 on gloo: with lr 0 the model never
    # changes, so rank 0 logs one loss at every validation exactly when the batches are the same.
    from titan_launch import CONFIGS, launch

    run = launch(CONFIGS / "cpu_2x2_hsdp_adamw.toml", tmp_path / "dump",
                 "--training.steps", "4", "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "0",
                 "--validation.enable", "--validation.freq", "2", "--validation.steps", "3",
                 "--validation.dataset", VALIDATION_DATASET_NAME, "--validation.local_batch_size", "2",
                 "--validation.seq_len", "128", assets=assets, timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    losses = run.validation_losses(0)
    assert sorted(losses) == [1, 2, 4] and len(set(losses.values())) == 1, losses
    # The log names what was read: the training corpus's sha256 and the digest of the held-out windows
    # scored (windows 0..23 in order: 3 steps x batch 2 x 4 data ranks), which benchmarks/titan_logs.py
    # reads into runs.csv for paired_seeds.py's same-data check.
    import titan_logs

    from flexdemo.data import load_corpus
    from flexdemo.data.tokenizer import FileTokenizer
    from flexdemo.data.heldout import HeldOutTokens

    (tmp_path / "console.log").write_text(run.output)
    logged = titan_logs.parse(tmp_path / "console.log")
    windows = HeldOutTokens(load_corpus(assets)["validation"], FileTokenizer(str(assets)), 128).tokens[:24]
    assert logged.heldout_digest == hashlib.sha256(windows.to(torch.int32).numpy().tobytes()).hexdigest()
    assert logged.corpus_sha256 == hashlib.sha256((Path(assets) / "corpus.json").read_bytes()).hexdigest()[:16]


def test_consensus_validator_scores_the_common_parameters():
    # overlap_lookahead: a real DeMo's consensus() around the wrapped validation; the validator
    # sees the base, the live (look-ahead) parameters come back bit for bit after it.
    from flexdemo import DeMo
    from flexdemo.titan.metrics import ConsensusValidator

    params = [torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()]
    opt = DeMo(params, lr=0.01, compression_topk=8, overlap=True, lookahead=True)
    params[0].grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    opt.step()
    live = params[0].detach().clone()
    base = opt.state[params[0]]["lookahead_base"].clone()
    assert not torch.equal(live, base)  # a look-ahead is on

    class Seen:
        should_validate = staticmethod(lambda step: True)

        def validate(self, model_parts, step):
            self.params = params[0].detach().clone()
            return "scored"

    inner = Seen()
    wrapped = ConsensusValidator(inner, opt.consensus)
    assert wrapped.validate([], 1) == "scored" and wrapped.should_validate(1)
    assert torch.equal(inner.params, base) and torch.equal(params[0].detach(), live)
