"""Tests for the offline stdlib corpus, its tokenizer and the torchtitan dataloader."""

import hashlib
import json
import multiprocessing
import os
import sys
from pathlib import Path

import pytest
import torch

from flexdemo.data import assets, corpus, ensure_assets, load_corpus, read_manifest
from flexdemo.data.tokenizer import BOS_TOKEN, EOS_TOKEN, VOCAB_SIZE
from titan_launch import write_own_tokenizer
from torchtitan_version import needs_torchtitan_0_2

@pytest.fixture(scope="module")
def assets_dir(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("assets") / "stdlib")


def _job_config(assets_dir, *extra):
    from torchtitan.config import ConfigManager

    args = ["--model.hf_assets_path", str(assets_dir), "--training.dataset", "flexdemo_stdlib"]
    return ConfigManager().parse_args([*args, *extra])


class CharTokenizer:
    """Stand-in tokenizer: one id per character, BOS=1, EOS=2, so streams decode exactly."""

    bos_id, eos_id = 1, 2

    def encode(self, text, add_bos=False, add_eos=False):
        return [self.bos_id] * add_bos + [ord(c) + 3 for c in text] + [self.eos_id] * add_eos


def _docs_in_stream(tokens):
    text = "".join("\x00" if t in (1, 2) else chr(t - 3) for t in tokens)
    return [d for d in text.split("\x00") if d]


# ---------------------------------------------------------------- corpus


def test_corpus_is_deterministic_and_split_by_file():
    a, b = corpus.build_corpus(), corpus.build_corpus()
    assert a == b
    assert len(a["train"]) > 500 and len(a["validation"]) > 5
    assert 2_000_000 < sum(map(len, a["train"])) < 20_000_000  # "a few MB"
    files = corpus.list_source_files()
    assert files == sorted(files)
    assert not any("/test/" in f or f.split("/")[-1].startswith("test_") for f in files)
    # Whole files go to one split: no header appears in both.
    header = lambda d: d.split("\n", 1)[0]
    assert not {header(d) for d in a["train"]} & {header(d) for d in a["validation"]}
    assert len(set(a["train"])) == len(a["train"])


def test_manifest_matches_files(assets_dir):
    manifest = read_manifest(assets_dir)
    assert manifest["vocab_size"] == VOCAB_SIZE
    assert set(manifest["sha256"]) == {"corpus.json", "tokenizer.json", "tokenizer_config.json"}
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256(Path(assets_dir, name).read_bytes()).hexdigest() == digest
    assert load_corpus(assets_dir) == corpus.build_corpus()


def test_cli_prints_assets_dir(assets_dir, capsys):
    from flexdemo.data.__main__ import main

    assert main(["--out", str(assets_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(assets_dir)


def test_default_dir_honours_env_and_python_version(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEXDEMO_CACHE", str(tmp_path))
    d = assets.default_assets_dir()
    assert d.startswith(str(tmp_path)) and f"py{sys.version_info.major}.{sys.version_info.minor}" in d


def test_pysource_cache_key_follows_the_installed_distributions(monkeypatch, tmp_path):
    # The pysource corpus is read from the source roots, so its cache key must change when a
    # distribution there is added, upgraded or removed, and only then.
    from flexdemo.data import pysource

    monkeypatch.setattr(pysource, "source_roots", lambda: [tmp_path])
    (tmp_path / "mod.py").write_text("x = 1\n")
    keys = [pysource.environment_fingerprint()]
    (tmp_path / "foo-1.0.dist-info").mkdir()
    keys.append(pysource.environment_fingerprint())
    (tmp_path / "foo-1.0.dist-info").rename(tmp_path / "foo-1.1.dist-info")
    keys.append(pysource.environment_fingerprint())
    (tmp_path / "bar-2.0.egg-info").mkdir()
    keys.append(pysource.environment_fingerprint())
    (tmp_path / "other.py").write_text("y = 2\n")  # not a distribution: same key
    assert pysource.environment_fingerprint() == keys[-1]
    assert len(set(keys)) == len(keys), keys


def _cli_worker(out, results):
    from flexdemo.data.__main__ import main

    results.put(main(["--out", out]))


def test_concurrent_builders_do_not_corrupt(assets_dir, tmp_path):
    # Three CLI entry points race on one empty dir (forked: no torch re-import);
    # the result must equal the fixture's build (so this is also the build-twice test).
    out = tmp_path / "shared"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_cli_worker, args=(str(out), results)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert [results.get(timeout=5) for _ in procs] == [0, 0, 0]
    for name in ("corpus.json", "tokenizer.json", "tokenizer_config.json", "manifest.json"):
        assert (out / name).is_file()
    for name in ("corpus.json", "tokenizer.json", "tokenizer_config.json", "manifest.json"):
        if name == "manifest.json":  # differs only in the build time it records
            strip = lambda p: {k: v for k, v in json.loads(p.read_text()).items() if k != "build_seconds"}
            assert strip(out / name) == strip(Path(assets_dir, name))
            continue
        assert (out / name).read_bytes() == Path(assets_dir, name).read_bytes()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no stray temp files


def _write_sources(root: Path, seed: int, count: int) -> list[str]:
    """``count`` distinct Python-like files of 2-5 KB under ``root``; returns their texts."""
    import random

    rng = random.Random(seed)
    texts = []
    for i in range(count):
        body = "".join(f"def f_{seed}_{i}_{j}(x):\n    return x * {rng.random()!r}\n\n" for j in range(rng.randint(40, 90)))
        path = root / f"pkg{i % 7}" / f"mod_{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
        texts.append(body)
    return texts


def test_pysource_corpus_is_deduplicated_filtered_deterministic_and_split(tmp_path):
    from flexdemo.data.pysource import MAX_CHARS, build_pysource_corpus

    a, b = tmp_path / "site-a", tmp_path / "site-b"
    texts = _write_sources(a, 1, 300)
    (b / "copy").mkdir(parents=True)
    (b / "copy" / "same.py").write_text(texts[0])  # the same module installed twice
    (b / "tiny.py").write_text("x = 1\n")  # too short
    (b / "huge.py").write_text("# " + "y" * MAX_CHARS)  # generated-table sized
    (b / "latin1.py").write_bytes(b"# caf\xe9\n" * 400)  # not UTF-8
    (b / "notes.txt").write_text("prose " * 1000)  # not source code
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "cached.py").write_text(texts[1] + "# cached\n")
    (b / "crlf.py").write_bytes(texts[2].replace("\n", "\r\n").encode() + b"# crlf\r\n")

    one = build_pysource_corpus([a, b])
    assert one == build_pysource_corpus([b, a])  # roots and walk order do not matter
    docs = one["train"] + one["validation"]
    assert set(texts) <= set(docs) and texts[2] + "# crlf\n" in docs
    assert len(docs) == len(set(docs)) == len(texts) + 1  # the copy counted once
    assert not set(one["train"]) & set(one["validation"])
    assert 0 < len(one["validation"]) < 0.05 * len(docs)  # about 1 in 100 held out


@pytest.fixture(scope="module")
def pysource_dir(tmp_path_factory):
    return ensure_assets(tmp_path_factory.mktemp("pysource"), corpus="pysource")


def test_pysource_assets_are_deterministic_and_report_their_size(pysource_dir, assets_dir, tmp_path):
    manifest = read_manifest(pysource_dir)
    assert manifest["corpus"] == "pysource"
    # The same environment gives the same bytes.
    again = ensure_assets(tmp_path / "again", corpus="pysource")
    assert read_manifest(again)["sha256"] == manifest["sha256"]
    # The stdlib corpus's tokenizer, so both corpora tokenize alike.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert Path(pysource_dir, name).read_bytes() == Path(ensure_assets(), name).read_bytes()
    splits = load_corpus(pysource_dir)
    assert not set(splits["train"]) & set(splits["validation"])
    assert manifest["num_chars"]["train"] == sum(map(len, splits["train"]))
    # Much larger than the stdlib corpus on any machine with torch installed.
    assert manifest["estimated_tokens"]["train"] > 20 * read_manifest(assets_dir)["estimated_tokens"]["train"]
    assert manifest["estimated_tokens"]["validation"] > 0
    with pytest.raises(ValueError, match="holds the 'pysource' corpus"):
        ensure_assets(pysource_dir, corpus="stdlib")


@needs_torchtitan_0_2
def test_pysource_dataset_serves_through_the_dataloader(pysource_dir):
    from flexdemo.data.dataset import PYSOURCE_DATASET_NAME
    from flexdemo.titan.data import build_dataloader, build_tokenizer

    cfg = _job_config(pysource_dir, "--training.dataset", PYSOURCE_DATASET_NAME, "--training.seq_len", "64",
                      "--training.local_batch_size", "2")
    tok = build_tokenizer(cfg)
    batch = next(iter(build_dataloader(dp_world_size=2, dp_rank=1, tokenizer=tok, job_config=cfg)))
    inputs, labels = batch
    assert inputs["input"].shape == (2, 64) and labels.shape == (2, 64)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips(assets_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(assets_dir, "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB_SIZE
    samples = load_corpus(assets_dir)["validation"][:5] + ["naïve café — 東京 🐍\n\ttabs\r\n", ""]
    for text in samples:
        assert tok.decode(tok.encode(text).ids) == text
    # It learned something: code compresses well below one token per byte.
    text = "\n".join(load_corpus(assets_dir)["validation"][:5])
    assert len(tok.encode(text).ids) < 0.5 * len(text.encode("utf-8"))


@needs_torchtitan_0_2
def test_torchtitan_tokenizer_loads_with_bos_eos(assets_dir):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer, build_hf_tokenizer
    from torchtitan.models.llama3 import llama3_args

    tok = build_hf_tokenizer(_job_config(assets_dir))
    assert isinstance(tok, HuggingFaceTokenizer)
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.bos_id == 0 and tok.eos_id == 1
    ids = tok.encode("import os\n", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.bos_id not in ids[1:-1] and tok.eos_id not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == "import os\n"
    # Fits the llama3 debugmodel embedding table as is.
    assert tok.get_vocab_size() <= llama3_args["debugmodel"].vocab_size


def test_a_partial_build_is_redone(assets_dir, tmp_path):
    # A crash mid-build leaves some files but no manifest: the next call redoes it.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "corpus.json").write_text("garbage")
    ensure_assets(partial)
    assert (partial / "manifest.json").is_file()
    for name in ("corpus.json", "tokenizer.json"):
        assert (partial / name).read_bytes() == Path(assets_dir, name).read_bytes()


@needs_torchtitan_0_2
def test_a_configs_own_tokenizer_is_kept(tmp_path):
    from flexdemo.titan.data import build_tokenizer, embedded_tokenizer_dir

    own = write_own_tokenizer(tmp_path / "own")
    cfg = _job_config(own)  # flexdemo_stdlib data, the user's tokenizer
    assert embedded_tokenizer_dir(cfg) == (None, None)
    tok = build_tokenizer(cfg)
    assert cfg.model.hf_assets_path == str(own) and tok.get_vocab_size() != VOCAB_SIZE
    assert not (own / "corpus.json").exists()  # nothing written into the user's directory


@pytest.mark.parametrize("path,dataset,uses_embedded", [
    ("missing", "flexdemo_stdlib", True),   # asks for the embedded data, names no tokenizer
    ("", "c4", True),                       # names no tokenizer at all
    ("missing", "c4", False),               # torchtitan's data and a path: the config's to fix
])
@needs_torchtitan_0_2
def test_embedded_tokenizer_only_where_the_config_needs_it(tmp_path, path, dataset, uses_embedded):
    from flexdemo.titan.data import build_tokenizer, check_tokenizer_available, embedded_tokenizer_dir

    path = str(tmp_path / path) if path else ""
    cfg = _job_config(path, "--training.dataset", dataset)
    assets, reason = embedded_tokenizer_dir(cfg)
    if uses_embedded:
        assert assets == ensure_assets() and "holds no tokenizer; using flexdemo's embedded tokenizer" in reason
        check_tokenizer_available(cfg)
        assert build_tokenizer(cfg).get_vocab_size() == VOCAB_SIZE and cfg.model.hf_assets_path == assets
    else:
        assert (assets, reason) == (None, None)
        with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
            check_tokenizer_available(cfg)
    assert not os.path.exists(os.path.join(path or "/nonexistent", "manifest.json"))


# ---------------------------------------------------------------- dataset


def test_dp_shards_are_disjoint_and_cover_everything():
    from flexdemo.data.dataset import StdlibTextDataset

    docs = [f"document number {i} " * (1 + i % 3) for i in range(23)]
    seen = []
    for rank in range(3):
        ds = StdlibTextDataset(docs, CharTokenizer(), seq_len=1, dp_rank=rank, dp_world_size=3)
        tokens = []
        for x, y in ds:
            assert x["input"].shape == (1,) and torch.equal(x["input"][1:], y[:-1])
            tokens += [int(x["input"][0]), int(y[0])]
        seen.append(_docs_in_stream(tokens))
    sets = [set(s) for s in seen]
    assert all(len(s) == len(seen[i]) for i, s in enumerate(sets))  # each doc once per epoch
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert set().union(*sets) == set(docs)


@needs_torchtitan_0_2
def test_real_ranks_get_different_batches(assets_dir):
    from flexdemo.titan.data import build_dataloader
    from torchtitan.components.tokenizer import build_hf_tokenizer

    cfg = _job_config(assets_dir, "--training.seq_len", "128", "--training.local_batch_size", "4")
    tok = build_hf_tokenizer(cfg)
    firsts = []
    for rank in range(2):
        x, y = next(iter(build_dataloader(dp_world_size=2, dp_rank=rank, tokenizer=tok, job_config=cfg)))
        assert x["input"].shape == y.shape == (4, 128) and x["input"].dtype == torch.int64
        assert torch.equal(x["input"][:, 1:], y[:, :-1])
        assert int(x["input"].max()) < tok.get_vocab_size()
        firsts.append(x["input"])
    assert not torch.equal(firsts[0], firsts[1])


@needs_torchtitan_0_2
def test_resume_is_bit_exact_through_parallel_aware_dataloader(assets_dir):
    from flexdemo.titan.data import build_dataloader
    from torchtitan.components.tokenizer import build_hf_tokenizer

    cfg = _job_config(assets_dir, "--training.seq_len", "256", "--training.local_batch_size", "2")
    tok = build_hf_tokenizer(cfg)
    make = lambda: build_dataloader(dp_world_size=4, dp_rank=3, tokenizer=tok, job_config=cfg)
    dl = make()
    it = iter(dl)
    for _ in range(7):
        next(it)
    state = dl.state_dict()
    expected = [next(it) for _ in range(5)]
    resumed = make()
    resumed.load_state_dict(state)
    got = [b for b, _ in zip(resumed, range(5))]
    for (ex, ey), (gx, gy) in zip(expected, got):
        assert torch.equal(ex["input"], gx["input"]) and torch.equal(ey, gy)
    fresh = next(iter(make()))
    assert not torch.equal(fresh[0]["input"], got[0][0]["input"])  # the state mattered


def test_resume_across_epoch_boundary_and_epochs_reshuffle():
    from flexdemo.data.dataset import StdlibTextDataset

    docs = [f"doc {i}: " + "abc" * i for i in range(10)]
    make = lambda: StdlibTextDataset(docs, CharTokenizer(), seq_len=7, infinite=True)
    ds = make()
    it = iter(ds)
    stream = [next(it) for _ in range(60)]  # several passes over 10 short docs
    assert ds._epoch >= 2
    ref = make()
    it = iter(ref)
    for _ in range(23):
        next(it)
    state = ref.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    rit = iter(resumed)
    for x, y in stream[23:]:
        rx, ry = next(rit)
        assert torch.equal(x["input"], rx["input"]) and torch.equal(y, ry)
    # Epoch orders differ, but each epoch holds every document.
    from flexdemo.data.dataset import document_order

    assert document_order(10, 0, 0) != document_order(10, 0, 1)
    assert sorted(document_order(10, 0, 1)) == list(range(10))


@needs_torchtitan_0_2
def test_other_datasets_delegate_to_torchtitan(assets_dir, monkeypatch):
    from flexdemo.titan import data as fd

    calls = []
    monkeypatch.setattr(fd.tt_text, "build_text_dataloader", lambda **kw: calls.append(kw) or "tt")
    cfg = _job_config(assets_dir, "--training.dataset", "c4_test")
    assert fd.build_dataloader(dp_world_size=1, dp_rank=0, tokenizer=None, job_config=cfg) == "tt"
    assert calls and calls[0]["job_config"] is cfg


@needs_torchtitan_0_2
def test_validation_split_via_torchtitan_registry(assets_dir):
    from torchtitan.components.tokenizer import build_hf_tokenizer
    from torchtitan.hf_datasets.text_datasets import build_text_validation_dataloader

    from flexdemo.data.dataset import VALIDATION_DATASET_NAME
    from flexdemo.titan.data import register_torchtitan_datasets

    register_torchtitan_datasets()  # also done when flexdemo.titan.data is imported
    cfg = _job_config(
        assets_dir,
        *("--validation.dataset", VALIDATION_DATASET_NAME, "--validation.dataset_path", str(assets_dir)),
        *("--validation.seq_len", "512", "--validation.local_batch_size", "4"),
    )
    tok = build_hf_tokenizer(cfg)
    n = sum(1 for _ in build_text_validation_dataloader(1, 0, tok, cfg, infinite=False))
    val_tokens = sum(len(tok.encode(d, add_bos=True, add_eos=True)) for d in load_corpus(assets_dir)["validation"])
    assert n == val_tokens // 513 // 4 + (val_tokens // 513 % 4 > 0)


def _check_worker(rank, store_path, assets_dir, shift, errors):
    import torch.distributed as dist
    from flexdemo.data.same_data import check_same_data_on_all_ranks

    class Shifted(CharTokenizer):
        def encode(self, text, **kw):
            return [t + shift * rank for t in super().encode(text, **kw)]

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        check_same_data_on_all_ranks(assets_dir, Shifted(), "flexdemo_stdlib")
    except RuntimeError:
        errors.put(rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shift", [0, 1])
def test_ranks_with_different_tokenizers_fail_fast(assets_dir, tmp_path, shift):
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_check_worker, args=(r, str(tmp_path / "store"), assets_dir, shift, errors))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    failed = sorted(errors.get(timeout=5) for _ in range(2)) if shift else []
    assert failed == ([0, 1] if shift else [])
    assert errors.empty()
