"""Checkpoints that move (CPU, torchtitan through scripts/launch.sh): a per-step run resumed
on 4 replicas x 1 shard, then on 2 x 1 (2 processes) and back on 2 x 2, so the data-parallel
world size that torchtitan's dataloader is built for goes 4 -> 4 -> 2 -> 4, with the data
position checked against a replay of the corpus; optimizers switched through a model-only
checkpoint in both directions; a checkpoint of other settings, or a data position that cannot be
resharded, refused before any rank starts."""

import pickle
import random
import re
import shutil

import pytest

from flexdemo.data.dataset import StdlibTextDataset
from flexdemo.data.resharding import reshard_dataset_states, unread_documents
from titan_launch import CONFIGS, launch, load_dcp
from torchtitan_version import needs_torchtitan_0_2

DEMO = CONFIGS / "cpu_2x2_flexdemo.toml"
HSDP = CONFIGS / "cpu_2x2_hsdp_adamw.toml"
TIMEOUT = 400


def _steps(steps, every):
    return ("--training.steps", str(steps), "--checkpoint.enable", "--checkpoint.interval", str(every),
            "--checkpoint.no-last-save-model-only", "--flexdemo.replica_check_interval", str(every))


def _topology(replicas, shards):
    return ("--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shards))


def _resume_from(run, step, dump):
    shutil.copytree(run.dump / "checkpoint" / f"step-{step}", dump / "checkpoint" / f"step-{step}")
    return dump


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory, assets):
    run = launch(DEMO, tmp_path_factory.mktemp("a"), *_steps(4, 4), *_topology(2, 2), assets=assets, timeout=TIMEOUT)
    assert run.returncode == 0, run.output[-6000:]
    return run


def _said(run, rank, text):
    return any(text in line for line in run.rank_lines(rank))


# cpu_2x2_flexdemo.toml's data: flexdemo_stdlib, local batch 2, seq_len 128, seed 1234.
LOCAL_BATCH, SEQ_LEN, SEED = 2, 128, 1234
HANDED = re.compile(r"flexdemo_stdlib: \d+ documents.*, dp (\d+)/(\d+)$")


class _RecordingTokenizer:
    """The run's tokenizer, noting which documents it encodes (every stdlib document is unique)."""

    def __init__(self, tokenizer, documents):
        self.tokenizer, self.index, self.read = tokenizer, {d: i for i, d in enumerate(documents)}, []

    def encode(self, text, **kw):
        self.read.append(self.index[text])
        return self.tokenizer.encode(text, **kw)


@pytest.fixture(scope="module")
def corpus(assets):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from flexdemo.data.assets import load_corpus

    documents = load_corpus(assets)["train"]
    return documents, HuggingFaceTokenizer(str(assets))


def _handed(run, procs):
    """(dp rank, dp world size) that each rank's dataloader was built for, as it logged them."""
    return [[tuple(map(int, m.groups())) for line in run.rank_lines(r) if (m := HANDED.search(line))]
            for r in range(procs)]


def _data_states(run, step):
    """Each data-parallel rank's dataset state in the run's checkpoint at ``step``, in rank order."""
    saved = load_dcp(run.dump / "checkpoint" / f"step-{step}")["dataloader"]
    return [pickle.loads(saved[f"dp_rank_{r}"])["dataset_state"] for r in range(saved["world_size"])]


def _replay(corpus, starts, steps, log):
    """Every rank of len(starts) reading ``steps`` batches from its state ``starts[r]`` (None:
    fresh) outside torchtitan; the documents each encodes go to ``log``, the samples' tokens
    are counted. Returns the states after, and the number of tokens sampled."""
    documents, tokenizer = corpus
    states, sampled = [], 0
    for rank, start in enumerate(starts):
        recorder = _RecordingTokenizer(tokenizer, documents)
        ds = StdlibTextDataset(documents, recorder, seq_len=SEQ_LEN, dp_rank=rank, dp_world_size=len(starts),
                               infinite=True, seed=SEED)
        if start is not None:
            ds.load_state_dict(start)
        samples = iter(ds)
        for _ in range(steps * LOCAL_BATCH):
            sampled += len(next(samples)[1]) + 1  # one window of seq_len + 1 tokens
        states.append(ds.state_dict())
        log += recorder.read
    return states, sampled


@needs_torchtitan_0_2
def test_resume_changing_replicas_shards_and_data_parallel_world_size(two_by_two, corpus, tmp_path, assets):
    # torchtitan builds the dataloader for the "batch" mesh, replicas x shards (FlexTrainer's
    # replica-local view comes after it): 2 x 2 and 4 x 1 on 4 processes both hand rank r (r, 4);
    # the world size changes only with the number of processes: 2 x 1 on 2 hands (r, 2).
    # The middle run keeps DeMo's momentum in host memory: its checkpoints move in and out of it.
    host = ("--flexdemo.momentum_device", "cpu")
    hops = [  # replicas, shards, processes, last step, a rank, what it says of the optimizer state, flags
        (4, 1, 4, 6, 3, "(written by 2 replicas x 2 shards) on 4 x 1: replica 3 takes saved replica 1's own state", ()),
        (2, 1, 2, 8, 1, "(written by 4 replicas x 1 shards) on 2 x 1: replica 1 takes saved replica 1's own state", host),
        (2, 2, 4, 10, 2, "(written by 2 replicas x 1 shards) on 2 x 2: replica 1 takes saved replica 1's own state", ()),
    ]
    documents = corpus[0]
    read = []  # every document the replay encodes, all ranks, in every run
    expected, sampled = _replay(corpus, [None] * 4, 4, read)
    assert _handed(two_by_two, 4) == [[(r, 4)] for r in range(4)]
    assert _data_states(two_by_two, 4) == expected
    previous, step, world = two_by_two, 4, 4
    for replicas, shards, procs, last, rank, said, flags in hops:
        dump = _resume_from(previous, step, tmp_path / f"to{replicas}x{shards}")
        run = launch(DEMO, dump, *_steps(last, last - step), *_topology(replicas, shards), *flags, assets=assets,
                     timeout=TIMEOUT, nproc=procs)
        assert run.returncode == 0, run.output[-6000:]
        assert _said(run, 0, "momentum=float32 on cpu") == bool(flags)
        assert sorted(run.losses(0)) == list(range(step + 1, last + 1))  # resumed, and ran to the end
        assert _said(run, rank, said)
        d = run.digests(ranks=range(procs))  # rank = replica x shards + shard: replicas bit-identical
        assert all(d[(r, last)] == d[(r % shards, last)] for r in range(procs)), d
        assert _handed(run, procs) == [[(r, procs)] for r in range(procs)]
        # The data position: what the saved ranks left, on this world size by the documented rule ...
        starts = expected
        if procs != world:
            starts = [reshard_dataset_states(expected, len(documents), r, procs, SEED) for r in range(procs)]
            assert all(_said(run, r, f"position saved by {world} data-parallel ranks resharded onto {procs}")
                       for r in range(procs))
        # ... read on for last - step batches: each rank's checkpointed state is the replay's.
        expected, more = _replay(corpus, starts, last - step, read)
        sampled += more
        assert _data_states(run, last) == expected, (replicas, shards)
        previous, step, world = run, last, procs
    # Nothing read twice in the epoch (all runs, all ranks), nothing skipped: what has been read and
    # what is left unread of the epoch make the corpus; every token read was sampled or is buffered.
    assert all(state["epoch"] == 1 for state in expected)  # epoch 0's documents handed over, not all read
    assert len(set(read)) == len(read), "a document was read twice"
    unread = [doc for state in expected for doc in state["pending"][state["pending_idx"]:]]
    assert sorted(read + unread) == list(range(len(documents)))
    tokenizer = corpus[1]
    buffered = sum(len(state["token_buffer"]) for state in expected)
    assert sum(len(tokenizer.encode(documents[i], add_bos=True, add_eos=True)) for i in read) == sampled + buffered


def test_resharding_rule_reads_every_document_once():
    # The rule of reshard_dataset_states on a small corpus and tokenizer, every way between 1, 2, 3, 4
    # and 6 data-parallel ranks, twice in a row (a resharding before the first one is read out).
    class Tok:
        def __init__(self):
            self.read = []

        def encode(self, text, add_bos, add_eos):
            self.read.append(int(text.split(":")[0]))
            return [1] + [ord(c) for c in text] + [2]

    rng = random.Random(0)
    documents = [f"{i}:" + "x" * rng.randint(1, 300) for i in range(97)]

    def read(starts, samples, log):
        states, tokens = [], 0
        for rank, start in enumerate(starts):
            tok = Tok()
            ds = StdlibTextDataset(documents, tok, seq_len=31, dp_rank=rank, dp_world_size=len(starts),
                                   infinite=True, seed=5)
            if start is not None:
                ds.load_state_dict(start)
            it = iter(ds)
            tokens += sum(len(next(it)[1]) + 1 for _ in range(samples))
            states.append(ds.state_dict())
            log += tok.read
        return states, tokens

    for first in (1, 2, 3, 4, 6):
        for second in (1, 2, 3, 4, 6):
            third = 4 if second != 4 else 3
            log = []
            states, tokens = read([None] * first, 7, log)
            for world, samples in ((second, 2), (third, 3)):
                states, more = read([reshard_dataset_states(states, len(documents), r, world, 5)
                                     for r in range(world)], samples, log)
                tokens += more
            assert len(set(log)) == len(log), (first, second)
            left = [unread_documents(s, len(documents), r, third, 5) for r, s in enumerate(states)]
            assert {epoch for epoch, _ in left} == {0} and all(s["epoch"] == 1 for s in states)
            assert sorted(log + [doc for _, docs in left for doc in docs]) == list(range(len(documents))), (first, second)
            assert sum(len(documents[i]) + 2 for i in log) == tokens + sum(len(s["token_buffer"]) for s in states)


def test_switching_optimizers_through_a_model_only_checkpoint(tmp_path, assets):
    fresh_loss = None
    runs = [(HSDP, "off"), (DEMO, "demo"), (HSDP, "off")]  # AdamW -> FlexDeMo -> AdamW
    previous = None
    for i, (config, mode) in enumerate(runs):
        # 2 replicas x 1 shard: the switch is what is tested, not the layout (2 processes start faster)
        args = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "4",  # last save: model only
                *_topology(2, 1)]
        if previous is not None:
            args += ["--checkpoint.initial_load_path", str(previous.dump / "checkpoint" / "step-4")]
        run = launch(config, tmp_path / f"run{i}", *args, assets=assets, timeout=TIMEOUT, nproc=2)
        assert run.returncode == 0, run.output[-6000:]
        losses = run.losses(0)
        if previous is None:
            fresh_loss = losses[1]
        else:  # it started from the previous run's weights, not from scratch
            assert losses[1] < fresh_loss - 0.3, (mode, losses[1], fresh_loss)
        previous = run


@pytest.mark.parametrize("overrides,procs,message", [
    (("--flexdemo.topk", "16"), 4, "was written with [mode=demo,topk=32,chunk=64,value_encoding=sign,overlap=False], "
                                   "this run asks for [mode=demo,topk=16,"),
    (("--flexdemo.mode", "off"), 4, "this run asks for [mode=off]"),
    # a bf16 momentum keeps a rounding counter an fp32 one has not
    (("--flexdemo.momentum_dtype", "bfloat16"), 4, "this run asks for [mode=demo,topk=32,chunk=64,value_encoding=sign,"
                                                   "overlap=False,momentum_dtype=bfloat16]"),
    # torchtitan's own text dataloader cannot reshard a data position (flexdemo's corpora can).
    (("--training.dataset", "c4", *_topology(2, 1)), 2, "holds the data position of 4 data-parallel ranks, "
                                                        "this run has 2 (replicas x shards): torchtitan's dataloader "
                                                        "for dataset 'c4' cannot reshard it"),
])
def test_a_checkpoint_of_other_settings_is_refused(two_by_two, tmp_path, assets, overrides, procs, message):
    dump = _resume_from(two_by_two, 4, tmp_path / "d")
    run = launch(DEMO, dump, *_steps(6, 6), *overrides, assets=assets, timeout=120, nproc=procs)
    assert run.returncode != 0
    flat = " ".join(run.output.split())
    assert message in flat, run.output[-3000:]
    assert "--checkpoint.initial_load_model_only" in flat or "--checkpoint.exclude_from_loading dataloader" in flat
    assert "step:" not in run.output and "no GPU found" not in run.output  # refused before any rank started
