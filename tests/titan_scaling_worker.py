"""torchrun worker for test_titan_grad_scaling.py (4 gloo ranks = 2 replicas x 2 shards).

Builds the same tiny llama3 twice -- stock HSDP (mode "off") and flexdemo's shard-only
FSDP (mode "demo") -- with identical weights, runs one torchtitan-style backward
(loss sum / global token count) on per-rank data, and checks that the replica average
of the demo gradients equals HSDP's gradient: i.e. each replica's grad is its own
replica-mean grad, as single-replica training would produce.
"""

import os
import sys

from flexdemo.titan import cpu_shim

cpu_shim.apply()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.models.llama3 import parallelize_llama, Transformer, TransformerModelArgs  # noqa: E402

from flexdemo.titan.grad_scaling import scale_grads_to_replica_mean  # noqa: E402
from flexdemo.titan.parallelize import wrap_parallelize  # noqa: E402

SKIP_SCALING = os.environ.get("SKIP_SCALING") == "1"  # lets the test prove it can fail

dist.init_process_group("gloo")
dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=4)
dims.build_mesh()
shard, shards = dims.get_mesh("fsdp").get_local_rank(), 2
job = ConfigManager().parse_args([
    "--job.custom_config_module", "flexdemo.titan.config",
    "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none",
    "--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
])
args = TransformerModelArgs(dim=128, n_layers=2, n_heads=4, vocab_size=256, rope_theta=500000)
args.max_seq_len = 32

torch.manual_seed(0)
reference = Transformer(args)
reference.init_weights()
full = {k: v.detach().clone() for k, v in reference.named_parameters()}


def build(mode):
    job.flexdemo.mode = mode
    with torch.device("meta"):
        model = Transformer(args)
    model = wrap_parallelize(parallelize_llama)(model, dims, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
        for name, p in model.named_parameters():
            src = torch.chunk(full[name], shards, dim=0)[shard] if isinstance(p, DTensor) else full[name]
            (p.to_local() if isinstance(p, DTensor) else p).copy_(src)
    if mode == "demo" and not SKIP_SCALING:
        scale_grads_to_replica_mean([model], dims.dp_replicate)
    return model


# Each data-parallel rank sees different tokens, like torchtitan's dataloader.
g = torch.Generator().manual_seed(100 + dist.get_rank())
tokens = torch.randint(0, args.vocab_size, (2, 33), generator=g)
inputs, labels = tokens[:, :-1], tokens[:, 1:]
global_tokens = torch.tensor(float(labels.numel()))
dist.all_reduce(global_tokens, group=dims.get_mesh("batch").get_group())

grads = {}
for mode in ("off", "demo"):
    model = build(mode)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / global_tokens
    loss.backward()
    grads[mode] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}

replicate_group = dims.get_mesh("dp_replicate").get_group()
worst = 0.0
for name, g_demo in grads["demo"].items():
    avg = g_demo.clone()
    dist.all_reduce(avg, group=replicate_group)
    avg /= dims.dp_replicate
    ref = grads["off"][name]
    err = ((avg - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    worst = max(worst, err)
print(f"rank {dist.get_rank()} worst relative error {worst:.3e}", flush=True)
dist.destroy_process_group()
sys.exit(0 if worst < 1e-4 else 1)
