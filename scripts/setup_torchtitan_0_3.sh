#!/usr/bin/env bash
# A second environment with torchtitan 0.3.0 beside this Python's 0.2.2 (scripts/setup_env.sh),
# for the tests and runs on 0.3.0: a venv that sees this Python's packages (torch, Triton,
# torchft) and holds torchtitan 0.3.0 and what it needs over them (spmd_types,
# torch_checkpointing, datasets < 4.8, ...), with flexdemo from this checkout. Idempotent.
# Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${TORCHTITAN_0_3_VENV:-.venv-torchtitan-0.3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q "torchtitan==0.3.0" >&2
"$VENV/bin/python" -m pip install -q --no-deps -e . >&2
echo "$VENV/bin/python"
