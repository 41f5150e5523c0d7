#!/usr/bin/env bash
# Set up (scripts/setup_env.sh) and run the whole test suite on CPU with gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=1
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider tests "$@"
