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
# torchtitan 0.3.0, in a venv of its own beside this Python's 0.2.2: its end-to-end set (the TOML
# reader, --module/--config, every mode 2 x 2 with the replicas identical, resume, validation,
# elastic kill-and-heal, the shipped gpu_2gpu_* configs shrunk). FLEXDEMO_TORCHTITAN makes a wrong version
# stop the run, not skip it.
if PY03=$(PYTHON="$PY" bash scripts/setup_torchtitan_0_3.sh); then
  FLEXDEMO_TORCHTITAN=0.3 "$PY03" -m pytest -q -p no:cacheprovider "${XDIST[@]}" --durations=10 \
    tests/test_torchtitan_0_3.py tests/test_torchtitan_0_3_configs.py tests/test_titan_shipped_configs.py || status=1
else
  status=1
fi
exit $status
