"""Shared guard for the Triton-kernel tests, which run on CPU in Triton's interpreter.

TRITON_INTERPRET=1 must be set for the whole pytest run (Triton reads it when kernels are
decorated and when they launch), so the tests never set it themselves: it would leak into
every later test of the session. ``scripts/run_tests.sh`` gives them a run of their own.
"""

import os

import pytest


def fused_codec_or_skip():
    """``flexdemo.fused_codec`` when the interpreter is on; otherwise skip the calling module."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (Triton interpreter on CPU) for the whole pytest run",
                    allow_module_level=True)
    try:
        from flexdemo import fused_codec
    except Exception as e:  # pragma: no cover
        pytest.skip(f"triton unavailable: {e}", allow_module_level=True)
    if not (fused_codec._HAVE_TRITON and fused_codec._INTERPRET):
        pytest.skip("triton unavailable, or flexdemo.fused_codec imported before TRITON_INTERPRET was set",
                    allow_module_level=True)
    return fused_codec
