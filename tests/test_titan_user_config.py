"""A torchtitan user's own config, unchanged but for the plugin lines, through scripts/launch.sh:
its own tokenizer is used (never replaced by flexdemo's), it trains, replicas stay identical,
and the embedding rows of ids its tokenizer never produces do not move."""

import math

import torch

from titan_launch import launch, load_dcp, write_own_tokenizer

STEPS = 6

# torchtitan's llama3 debug config as a user has it (AdamW, warm-up then linear decay, the
# debugmodel flavor, FSDP over all ranks), the data set to flexdemo's offline corpus (the wheel
# ships no c4_test) and sized for 4 CPU processes; then the four plugin lines.
USER_CONFIG = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
custom_config_module = "flexdemo.titan.config"

[experimental]
custom_import = "flexdemo.titan.register"

[metrics]
log_freq = 1

[model]
name = "flexdemo_llama3"
flavor = "debugmodel"
hf_assets_path = "{tokenizer}"

[optimizer]
name = "AdamW"
lr = 8e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 2
seq_len = 128
max_norm = 1.0
steps = {steps}
dataset = "flexdemo_stdlib"
mixed_precision_param = "float32"

[parallelism]
data_parallel_replicate_degree = 2
data_parallel_shard_degree = -1

[activation_checkpoint]
mode = "none"

[flexdemo]
replica_check_interval = {steps}
"""


def test_users_own_tokenizer_is_used(tmp_path, assets):
    from tokenizers import Tokenizer

    from flexdemo.data.tokenizer import VOCAB_SIZE

    own = write_own_tokenizer(tmp_path / "tokenizer")
    ids = Tokenizer.from_file(str(own / "tokenizer.json")).get_vocab_size()
    assert ids < VOCAB_SIZE
    config = tmp_path / "debug_model.toml"
    config.write_text(USER_CONFIG.format(tokenizer=own, steps=STEPS))
    # The initial model as torchtitan's seed checkpoint (one process), which the run starts from;
    # the run's checkpoint at its end: the embedding at both.
    seed = launch(config, tmp_path / "seed", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                  "--parallelism.data_parallel_replicate_degree", "1", "--parallelism.data_parallel_shard_degree", "1",
                  assets=assets, timeout=200, nproc=1)
    assert seed.returncode == 0, seed.output[-4000:]
    start = tmp_path / "seed" / "checkpoint" / "step-0"
    run = launch(config, tmp_path / "dump", "--checkpoint.enable", "--checkpoint.interval", str(STEPS),
                 "--checkpoint.initial_load_path", str(start), "--checkpoint.initial_load_model_only",
                 assets=assets, timeout=400)
    assert run.returncode == 0, run.output[-6000:]
    log = run.rank_lines(0)
    assert f"tokenizer: {own} ({ids} ids)" in " ".join(log)
    assert "holds no tokenizer" not in run.output  # nothing replaced what the config names
    assert "flexdemo: DCT blocks per rank: 64x64 top-32:" in " ".join(log)  # the start-up summary
    assert f"Loading the checkpoint from {start}" in " ".join(log)  # it started from the seed
    losses = run.losses(0)
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values())
    d = run.digests()
    assert d[(0, STEPS)] == d[(2, STEPS)] and d[(1, STEPS)] == d[(3, STEPS)]

    # Ids >= the tokenizer's size are never looked up: their embedding rows get no gradient,
    # and whole 64-row DCT blocks of them must keep their initial values bit for bit (with sign
    # values they used to move by lr at every step: a kept zero read as a +1 vote). A block
    # shared with looked-up rows does spread its update over every row: that is the
    # compression, in every encoding.
    first, last = load_dcp(start), load_dcp(tmp_path / "dump" / "checkpoint" / f"step-{STEPS}")
    silent = -(-ids // 64) * 64
    emb0, emb1 = first["tok_embeddings.weight"], last["tok_embeddings.weight"]
    assert emb0.shape[0] - silent >= 64 * 16  # many whole silent blocks
    assert torch.equal(emb1[silent:], emb0[silent:])
    assert not torch.equal(emb1[:ids], emb0[:ids])  # the looked-up rows trained
