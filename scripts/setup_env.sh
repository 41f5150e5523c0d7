#!/usr/bin/env bash
# Install flexdemo and what it needs into the current Python (idempotent).
# On a machine without a GPU and without torch, take the CPU build of torch 2.13.0
# (an unpinned torch would pull a multi-GB CUDA build); where torch exists, keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.11"
  else
    "$PY" -m pip install -q "torch==2.13.0"
  fi
fi
# torchtitan 0.2.2 here: the GPU machines' version, under the whole test suite (0.3.0 in a venv
# of its own: scripts/setup_torchtitan_0_3.sh). The bench extra (matplotlib) lets the tests of
# benchmarks/plot.py run instead of skipping on a machine without it.
"$PY" -m pip install -q -e ".[test,ft,bench]" "torchtitan==${TORCHTITAN_VERSION:-0.2.2}"
