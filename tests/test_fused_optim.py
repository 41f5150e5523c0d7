"""DeMo's fused (Triton) path against its torch path; runs in Triton's CPU interpreter.

    TRITON_INTERPRET=1 python -m pytest tests/test_fused_optim.py
"""

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="needs TRITON_INTERPRET=1 (Triton on CPU)"
)

SHAPES = [(128, 64), (64, 192), (96, 130), (100,), (3, 64, 32)]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _grads(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(fused, steps, rank=0, encoding="sign"):
    from flexdemo import DeMo

    params = _params()
    opt = DeMo(params, lr=0.01, compression_decay=0.9, compression_topk=8, value_encoding=encoding, fused=fused,
               weight_decay=0.1)  # the fused decode applies the decay too
    for step in range(steps):
        for p, g in zip(params, _grads(step, rank)):
            p.grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("encoding", ["fp32", "sign", "scaled_sign"])
def test_fused_path_matches_torch_path(encoding):
    from flexdemo.kernels import fused_supported
    from flexdemo.compression.dct import block_layout

    fused_params, fused_opt = _run(True, 4, encoding=encoding)
    torch_params, torch_opt = _run(False, 4, encoding=encoding)
    assert all(fused_supported(block_layout(s, 64), "cpu") for s in SHAPES)  # 1-D too (1 x n2 blocks)
    assert fused_opt.last_step_bytes_sent == torch_opt.last_step_bytes_sent == fused_opt.payload_bytes_per_step()
    total = sum(p.numel() for p in torch_params)
    differing = sum(int((a != b).sum()) for a, b in zip(fused_params, torch_params))
    # Same index sets and decode; the DCT sums in another order, so a decoded value that is
    # ~0 may take the other sign now and then. Anything more means a real difference.
    assert differing <= 1e-3 * total, f"{differing} of {total} elements differ"
    for a, b in zip(fused_opt.state.values(), torch_opt.state.values()):
        torch.testing.assert_close(a["delta"], b["delta"], atol=1e-4, rtol=1e-4)


def test_topk_above_the_kernels_limit_takes_the_torch_path():
    # The fused kernels' work grows with K (gathered basis products, replica-overlap counts):
    # past MAX_TOPK buckets use the torch path (and still train: the step below runs it).
    from flexdemo import DeMo
    from flexdemo.kernels import MAX_TOPK

    for k, fused in ((MAX_TOPK, True), (MAX_TOPK + 1, False)):
        p = torch.randn(64, 64, generator=torch.Generator().manual_seed(k), requires_grad=True)
        opt = DeMo([p], lr=0.01, compression_topk=k, fused=True)
        assert opt.compressor.uses_fused_kernels == fused, k
        before = p.detach().clone()
        p.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        opt.step()
        assert not torch.equal(p.detach(), before)


def _replicas(rank, world):
    params, _ = _run(True, 3, rank=rank)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    out = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(out, flat)
    return all(torch.equal(o, out[0]) for o in out)


def test_fused_replicas_stay_bit_identical():
    from multiproc import run_ranks

    assert run_ranks(_replicas, 2) == [True, True]
