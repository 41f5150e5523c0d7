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
    params, opt = _build(fused, encoding)
    for step in range(steps):
        _step(params, opt, step, rank)
    return params, opt


def _build(fused, encoding):
    from flexdemo import DeMo

    params = _params()
    opt = DeMo(params, lr=0.01, compression_decay=0.9, compression_topk=8, value_encoding=encoding, fused=fused,
               weight_decay=0.1)  # the fused decode applies the decay too
    return params, opt


def _step(params, opt, step, rank=0):
    for p, g in zip(params, _grads(step, rank)):
        p.grad = g
    opt.step()


# Where the torch path's decoded direction is this small relative to the tensor's largest, its
# sign is rounding noise (the DCTs sum in another order): only there may the paths differ.
NEAR_ZERO = 1e-5


@pytest.mark.parametrize("encoding", ["fp32", "sign", "scaled_sign"])
def test_fused_path_matches_torch_path(encoding):
    from flexdemo.kernels import fused_supported
    from flexdemo.wire.dct import block_layout

    fused_params, fused_opt = _build(True, encoding)
    torch_params, torch_opt = _build(False, encoding)
    assert all(fused_supported(block_layout(s, 64), "cpu") for s in SHAPES)  # 1-D too (1 x n2 blocks)
    import titan_launch  # noqa: F401  (puts benchmarks/ on sys.path)
    from common import record_decoded_directions

    directions = record_decoded_directions(torch_opt)
    for step in range(4):
        _step(fused_params, fused_opt, step)
        _step(torch_params, torch_opt, step)
        assert fused_opt.last_step_bytes_sent == torch_opt.last_step_bytes_sent == fused_opt.payload_bytes_per_step()
        for i, (a, b) in enumerate(zip(fused_params, torch_params)):
            direction = directions[b.data_ptr()]
            differs = a.detach() != b.detach()
            noise = direction.abs() <= NEAR_ZERO * direction.abs().max()
            assert not (differs & ~noise).any(), (
                f"step {step}, parameter {i}: {int((differs & ~noise).sum())} elements differ where the update is "
                f"not ~0")
            with torch.no_grad():  # re-align where a ~0 direction took the other sign
                a.copy_(b)
        for a, b in zip(fused_opt.state.values(), torch_opt.state.values()):
            # the momentum after error feedback, relative to its own scale
            assert (a["delta"] - b["delta"]).abs().max() <= 1e-5 * b["delta"].abs().max()


@pytest.mark.parametrize("encoding", ["sign", "fp32"])
def test_fused_path_with_elias_fano_indices_trains_as_with_fixed_ones(encoding):
    # The fused encode and decode kernels around torch-op Elias-Fano pack/unpack: the same bits.
    from flexdemo import DeMo

    runs = []
    for coding in ("fixed", "elias_fano"):
        params = _params()
        opt = DeMo(params, lr=0.01, compression_decay=0.9, compression_topk=8, value_encoding=encoding,
                   weight_decay=0.1, index_coding=coding)
        assert opt.compressor.uses_fused_kernels
        for step in range(3):
            _step(params, opt, step)
        runs.append((params, opt.last_step_bytes_sent))
    (fixed, fixed_bytes), (ef, ef_bytes) = runs
    assert all(torch.equal(a, b) for a, b in zip(fixed, ef)) and ef_bytes < fixed_bytes


def test_two_bit_values_take_the_torch_path():
    # The kernels write fp32, bf16 and the 1-bit encodings; two_bit's levels are torch ops (a
    # fused encode would take error feedback of the unquantized values instead).
    from flexdemo import DeMo

    params = _params()
    opt = DeMo(params, lr=0.01, compression_topk=8, value_encoding="two_bit", fused=True)
    assert not opt.compressor.uses_fused_kernels
    _step(params, opt, 0)
    assert opt.last_step_bytes_sent > 0


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
