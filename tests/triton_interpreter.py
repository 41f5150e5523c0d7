"""Shared guard for the Triton-kernel tests, which run on CPU in Triton's interpreter.

TRITON_INTERPRET=1 must be set for the whole pytest run (Triton reads it when kernels are
decorated and when they launch), so the tests never set it themselves: it would leak into
every later test of the session. ``scripts/run_tests.sh`` gives them a run of their own.
"""

import os

import pytest


def kernels_or_skip():
    """``flexdemo.kernels`` when the interpreter is on; otherwise skip the calling module."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (Triton interpreter on CPU) for the whole pytest run",
                    allow_module_level=True)
    try:
        from flexdemo import kernels
    except Exception as e:  # pragma: no cover
        pytest.skip(f"triton unavailable: {e}", allow_module_level=True)
    if not (kernels.HAVE_TRITON and kernels.INTERPRET):
        pytest.skip("triton unavailable, or flexdemo.kernels imported before TRITON_INTERPRET was set",
                    allow_module_level=True)
    return kernels
