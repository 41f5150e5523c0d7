"""A small set of plain parameters and a loss over them, shared by the optimizer tests:
1-D and 2-D shapes, prime and non-multiple-of-64 dims, gradients that depend on the
parameters (so a divergence between implementations compounds)."""

import torch
import torch.distributed as dist

SHAPES = [(128, 64), (128,), (96, 130), (100,), (7, 11), (251, 3)]
INPUT_NUMEL = 2 * 128 * 130


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)  # same seed on every rank: replicas start identical
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def loss(params, x):
    total = 0.0
    for p in params:
        flat = p.reshape(-1)
        total = total + (torch.tanh(flat * x[: flat.numel()]) ** 2).sum() + (flat * x[-flat.numel():]).sum()
    return total


def backward_on(params, seed):
    """Fresh gradients of ``loss`` on an input drawn from ``seed`` (old grads dropped)."""
    x = torch.randn(INPUT_NUMEL, generator=torch.Generator().manual_seed(seed))
    for p in params:
        p.grad = None
    loss(params, x).backward()


def step_both(opt, reference, ours, ref, x):
    """One step of ``opt`` on ``ours`` and of ``reference`` on ``ref``, both on ``loss(., x)``."""
    for params in (ours, ref):
        for p in params:
            p.grad = None
        loss(params, x).backward()
    opt.step()
    reference.step()


def all_ranks_equal(tensors):
    """True iff every rank holds exactly the same tensors."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(o, out[0]) for o in out)


def run_from(build, steps, grads, state=None):
    """Fresh toy parameters and ``build(params)``'s optimizer, run through step ``steps - 1`` with
    ``grads(params, step)`` before each step; ``state = (first step, optimizer state dict, the
    exchange in flight, parameter values)`` resumes from a checkpoint of those first."""
    params = make_params()
    opt = build(params)
    first = 0
    if state is not None:
        first, opt_sd, pending, values = state
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        opt.load_state_dict(opt_sd)
        opt.load_pending_state(pending)
    for step in range(first, steps):
        grads(params, step)
        opt.step()
    return params, opt


def outer_sgd(params, lr=0.7, momentum=0.9, nesterov=True):
    """A DiLoCo's outer optimizer as a caller builds it (defaults: the TOML keys' outer_lr 0.7,
    outer_momentum 0.9, outer_nesterov)."""
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, nesterov=nesterov)
