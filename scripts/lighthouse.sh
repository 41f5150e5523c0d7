#!/usr/bin/env bash
# torchft's Lighthouse (its own binary, shipped in the torchft wheel: pip install -e ".[ft]"):
# it forms, before every step, the quorum of replicas that take part in it.
#   bash scripts/lighthouse.sh [PORT] [MIN_REPLICAS]
# Every replica then runs with TORCHFT_LIGHTHOUSE=http://THIS_HOST:PORT. MIN_REPLICAS (default
# 2) must be more than half of the replicas you start: a quorum smaller than that could form
# beside the live one (a restarted replica alone) and train apart from it.
# Dead replicas are dropped after HEARTBEAT_TIMEOUT_MS without a heartbeat (default 2000).
set -euo pipefail
PORT=${1:-29510}
MIN=${2:-2}
if ! command -v torchft_lighthouse >/dev/null; then
  echo "lighthouse.sh: torchft_lighthouse not found; install the extra: pip install -e \".[ft]\"" >&2
  exit 2
fi
exec torchft_lighthouse --min_replicas "$MIN" --bind "[::]:$PORT" \
  --quorum_tick_ms "${QUORUM_TICK_MS:-100}" --join_timeout_ms "${JOIN_TIMEOUT_MS:-1000}" \
  --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-2000}"
