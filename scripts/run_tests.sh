#!/usr/bin/env bash
# Set up (scripts/setup_env.sh) and run the whole test suite on CPU with gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
PY="${PYTHON:-python3}"
# The Triton kernels (GPU fast path) run on CPU in Triton's interpreter; the variable is
# read at every launch, so they get a run of their own.
# Both runs always run; the script fails if either did.
status=0
# Two workers (-n 2); --dist loadfile keeps a file's tests (and its module fixtures' shared runs)
# on one worker.
XDIST=(-n "${TEST_WORKERS:-2}" --dist loadfile)
TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/test_fused_codec.py tests/test_fused_grouped.py \
  tests/test_fused_optim.py tests/test_fused_overlap.py tests/test_fused_rounding.py || status=1
"$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" --durations=25 tests "$@" || status=1
exit $status
