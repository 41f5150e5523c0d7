"""DeMo's momentum in host memory (momentum_device="cpu"): streamed through working copies every
step, it must give the same bits as the momentum kept beside the parameters, in fp32 and bf16,
through the sharded exchange's give-back, a skipped step, FSDP shards and a checkpoint moved
between the two places. On CUDA (the GPU checks) it must also live in pinned host memory, leave
the GPU's memory by its size, and keep its bits with its copies on side streams."""

import copy
import gc

import pytest
import torch

from flexdemo import DeMo
from fsdp_toy import replica_mesh, shard_layers, toy_mlp
from multiproc import run_ranks

KW = dict(lr=0.01, compression_decay=0.95, compression_topk=16, compression_chunk=64, value_encoding="sign")


def _train(model, opt, gen, steps, poison_at=None, poison=False):
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=gen).to(next(model.parameters()).device)).square().mean().backward()
        if poison and step == poison_at:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()


def _momenta(model, opt):
    out = []
    for p in model.parameters():
        d = opt.state[p]["delta"]
        out.append((d.full_tensor() if hasattr(d, "full_tensor") else d).detach().cpu().clone())
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _host_vs_device(rank, world, steps, extra):
    """The same run twice, the momentum on the parameters' device and on the host; ``extra`` adds
    DeMo keywords (the dtype, the exchange) and "poison_at": a NaN gradient on replica 1 then."""
    extra = dict(extra)
    poison_at = extra.pop("poison_at", None)
    runs = []
    for where in ("device", "cpu"):
        model = toy_mlp(0)
        opt = DeMo(model.parameters(), momentum_device=where, **dict(KW, **extra))
        _train(model, opt, torch.Generator().manual_seed(100 + rank), steps, poison_at, poison=rank == 1)
        runs.append(([p.detach().clone() for p in model.parameters()], _momenta(model, opt),
                     opt.pop_skipped_steps(wait=True)))
    (p_dev, m_dev, s_dev), (p_host, m_host, s_host) = runs
    return _same(p_dev, p_host), _same(m_dev, m_host), s_dev == s_host, s_host


CASES = {
    "fp32": {},
    "bf16": dict(momentum_dtype="bfloat16"),
    "sharded_exchange": dict(value_encoding="fp32", exchange="sharded", sharded_topk=4),
    "bf16_sharded_exchange": dict(momentum_dtype="bfloat16", value_encoding="fp32", exchange="sharded",
                                  sharded_topk=4),
    "skipped_step": dict(poison_at=2),
}


@pytest.mark.parametrize("case", CASES)
def test_host_momentum_gives_the_same_bits_as_device_momentum(case):
    for params, momenta, same_skips, skips in run_ranks(_host_vs_device, 2, 5, CASES[case]):
        assert params and momenta and same_skips
        assert bool(skips) == ("poison_at" in CASES[case])  # the skipped step was seen, and only there


def _sharded_resume(rank, world, steps, at):
    """FSDP 2 x 2: a run whose momentum lives on the device, checkpointed at ``at`` through torch's
    distributed state dict (as torchtitan saves), resumed with the momentum on the host: the same
    parameters and momenta as the uninterrupted host-momentum run, and the momentum put on the host."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    mesh = replica_mesh(2, 2)
    group = mesh["replicate"].get_group()
    gen_seed = 100 + mesh["replicate"].get_local_rank()

    def build(where):
        model = shard_layers(toy_mlp(0), mesh["shard"])
        return model, DeMo(model.parameters(), replicate_group=group, momentum_device=where, **KW)

    whole, whole_opt = build("cpu")
    _train(whole, whole_opt, torch.Generator().manual_seed(gen_seed), steps)

    first, first_opt = build("device")
    gen = torch.Generator().manual_seed(gen_seed)
    _train(first, first_opt, gen, at)
    model_state = copy.deepcopy(first.state_dict())
    saved = copy.deepcopy(get_optimizer_state_dict(first, first_opt))
    resumed, resumed_opt = build("cpu")
    resumed.load_state_dict(model_state)
    set_optimizer_state_dict(resumed, resumed_opt, saved)
    on_host = all(resumed_opt.state[p]["delta"].to_local().device.type == "cpu" for p in resumed.parameters())
    _train(resumed, resumed_opt, gen, steps - at)
    params = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(whole.parameters(),
                                                                             resumed.parameters()))
    return params, _same(_momenta(whole, whole_opt), _momenta(resumed, resumed_opt)), on_host


def test_a_device_momentum_checkpoint_resumes_on_the_host_as_uninterrupted():
    for params, momenta, on_host in run_ranks(_sharded_resume, 4, 6, 3):
        assert params and momenta and on_host


def test_bad_momentum_device_is_refused():
    with pytest.raises(ValueError, match="momentum_device"):
        DeMo(toy_mlp(0).parameters(), momentum_device="gpu", **KW)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU checks)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_the_momentum_is_pinned_on_the_host_and_the_bits_are_the_same(dtype):
    """One replica on one GPU, the fused kernels on: the same parameters and momenta as with the
    momentum on the GPU, each momentum a pinned host tensor, and the GPU's allocated memory after
    the steps smaller by at least the momentum's size."""
    runs = []
    for where in ("device", "cpu"):
        # DeMo sits in reference cycles: an earlier run's optimizer (this loop's, or another test's)
        # is freed only by the collector, which could otherwise run mid-measurement and free its
        # parameters and gradients there (on an H200 that made the device run look 0.46 MB lighter).
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        model = toy_mlp(0).cuda()
        opt = DeMo(model.parameters(), momentum_device=where, momentum_dtype=dtype, **KW)
        _train(model, opt, torch.Generator().manual_seed(7), 6)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        deltas = [opt.state[p]["delta"] for p in model.parameters()]
        runs.append(([p.detach().cpu() for p in model.parameters()], _momenta(model, opt), held, deltas))
        del model, opt
    (p_dev, m_dev, held_dev, d_dev), (p_host, m_host, held_host, d_host) = runs
    assert _same(p_dev, p_host) and _same(m_dev, m_host)
    assert all(d.is_cuda for d in d_dev)
    assert all(d.device.type == "cpu" and d.is_pinned() for d in d_host)
    assert held_dev - held_host >= sum(d.numel() * d.element_size() for d in d_host)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_at_most_three_chunks_of_working_copies_are_alive_at_once(dtype, monkeypatch):
    """The working copies stay bounded however many chunks a bucket has: when a chunk's upload
    starts, at most two earlier chunks' copies are still held (one being encoded, one going
    down). Holding them until the pass ends would put the whole bucket's momentum on the GPU."""
    import weakref

    from flexdemo.optim import host_copies, momentum_storage

    monkeypatch.setattr(momentum_storage, "CHUNK_ELEMENTS", 64 * 64)  # a chunk per tensor
    uploads, most = [], [0]
    real_upload = host_copies.HostCopies.upload

    def counting_upload(self, pairs):
        most[0] = max(most[0], sum(any(r() is not None for r in refs) for refs in uploads))
        uploads.append([weakref.ref(dst) for dst, _ in pairs])
        return real_upload(self, pairs)

    monkeypatch.setattr(host_copies.HostCopies, "upload", counting_upload)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    opt = DeMo(model.parameters(), momentum_device="cpu", momentum_dtype=dtype, **KW)
    _train(model, opt, torch.Generator().manual_seed(1), 2)
    assert len(uploads) >= 8 and 1 <= most[0] <= 2  # bf16: what goes down is the rounded copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU checks)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_chunks_copied_beside_the_encode_give_the_same_bits(dtype, monkeypatch):
    """Many chunks per bucket, so the side streams really overlap (one chunk going up, one
    encoded, one coming down) on tensors large enough for a missed wait to read a half-copied
    buffer: the same parameters as with the momentum on the GPU, and the same momenta read at once
    through the state dict (as a checkpoint reads them, with the last chunk's download just queued)."""
    from flexdemo.optim import momentum_storage

    monkeypatch.setattr(momentum_storage, "CHUNK_ELEMENTS", 1 << 20)
    runs = []
    for where in ("device", "cpu"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.Tanh(),
                                    *[m for _ in range(4) for m in (torch.nn.Linear(2048, 2048), torch.nn.Tanh())],
                                    torch.nn.Linear(2048, 4096, bias=False)).cuda()
        opt = DeMo(model.parameters(), momentum_device=where, momentum_dtype=dtype, **KW)
        _train(model, opt, torch.Generator().manual_seed(7), 4)
        # The last parameter first: its chunk's download is the one queued last.
        saved = [s["delta"].clone() for s in reversed(list(opt.state_dict()["state"].values()))]
        # Once the compute stream is done, so is every copy on the side streams.
        idle = all(c.down.query() and c.up.query() for c in opt.momentum._links.values())
        runs.append(([p.detach().cpu() for p in model.parameters()], [m.cpu() for m in saved], idle))
    (p_dev, m_dev, _), (p_host, m_host, idle) = runs
    assert _same(p_dev, p_host) and _same(m_dev, m_host)
    assert idle


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("where", ["device", "cpu"])
def test_loading_a_momentum_already_in_place_keeps_its_tensor(where, dtype):
    """DCP loads a checkpoint into the state's own tensors, then hands them to load_state_dict: a
    momentum already of the right dtype and place is kept, not copied (a copy would hold a second
    momentum at once, on the GPU or in host memory); another dtype is converted."""
    model = toy_mlp(0)
    opt = DeMo(model.parameters(), momentum_device=where, momentum_dtype=dtype, **KW)
    _train(model, opt, torch.Generator().manual_seed(3), 2)
    before = {id(p): opt.state[p]["delta"].data_ptr() for p in model.parameters()}
    opt.load_state_dict(opt.state_dict())
    assert all(opt.state[p]["delta"].data_ptr() == before[id(p)] for p in model.parameters())
    other = "float32" if dtype == "bfloat16" else "bfloat16"
    converted = DeMo(model.parameters(), momentum_device=where, momentum_dtype=other, **KW)
    converted.load_state_dict(opt.state_dict())
    assert all(converted.state[p]["delta"].dtype == getattr(torch, other) for p in model.parameters())
