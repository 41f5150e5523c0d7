"""overlap=True on the fused sign path applies exactly the update a run without overlap applies
one step later (benchmarks/check_overlap.py, here in Triton's CPU interpreter; `bash
benchmarks/gpu.sh checks` runs the same on two GPUs over NCCL).

    TRITON_INTERPRET=1 python -m pytest tests/test_fused_overlap.py
"""

import sys

from multiproc import run_ranks
from titan_launch import REPO
from triton_interpreter import kernels_or_skip

kernels_or_skip()
sys.path.insert(0, str(REPO / "benchmarks"))
from check_overlap import delayed_update_mismatches  # noqa: E402

SHAPES = [(128, 64), (96, 130), (100,)]  # whole, partial and 1-D blocks


def _check(rank, world, encoding):
    return delayed_update_mismatches("cpu", steps=5, shapes=SHAPES, encoding=encoding)


def test_fused_sign_overlap_is_the_hand_delayed_update_bit_for_bit():
    for out in run_ranks(_check, 2, "sign"):
        assert out["fused"], "the fused kernels did not run"
        assert out["every_update_moved"], "an update was all zero: the comparison would be vacuous"
        assert out["mismatched_steps"] == [], f"overlap differs from the delayed update at {out['mismatched_steps']}"
