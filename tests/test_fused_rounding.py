"""The stochastic-rounding kernel against its definition (flexdemo.wire.stochastic_rounding's
torch ops): the same bf16 bits for every element, whole tensors and boxes of larger ones."""

import pytest
import torch

from flexdemo.wire import stochastic_rounding as sr
from triton_interpreter import kernels_or_skip

kernels_or_skip()
from flexdemo.kernels.rounding import BLOCK, fused_stochastic_round  # noqa: E402


def _both(x, box, seed):
    ours = torch.empty(x.shape, dtype=torch.bfloat16)
    ref = torch.empty(x.shape, dtype=torch.bfloat16)
    fused_stochastic_round(ours, x, box, seed)
    sr.stochastic_round_torch(ref, x, box, seed)
    return ours, ref


@pytest.mark.parametrize("shape,box", [
    ((3000,), sr.Box(3000, 1, 1, row0=500, full_cols=1)),  # a 1-D shard, not a multiple of BLOCK
    ((37, 70), sr.Box(37, 70, 1)),  # a whole matrix
    ((16, 48), sr.Box(16, 48, 1, row0=32, col0=96, full_cols=192)),  # an FSDP x TP box
    ((5, 6, 7), sr.Box(5, 6, 7, row0=5, full_cols=6)),  # inner dims whole
])
def test_kernel_rounds_to_the_same_bits_as_the_definition(shape, box):
    g = torch.Generator().manual_seed(0)
    n = int(torch.tensor(shape).prod())
    x = torch.randn(shape, generator=g) * torch.logspace(-30, 30, n).reshape(shape)  # every exponent range
    x.view(-1)[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    for seed in (0, 12345, 2**32 - 1):
        ours, ref = _both(x, box, seed)
        nan = ref.isnan()
        assert torch.equal(ours.isnan(), nan)  # a NaN's payload bits are not the definition's business
        assert torch.equal(ours.view(torch.int16)[~nan], ref.view(torch.int16)[~nan]), (shape, seed)
    assert n > BLOCK or shape != (3000,)  # the 1-D case spans several programs, the last one partial


def test_kernel_hash_constant_is_the_definitions():
    import inspect

    from flexdemo.kernels import rounding

    assert f"{sr.MIX:#X}".replace("0X", "0x") in inspect.getsource(rounding._mix32.fn)
