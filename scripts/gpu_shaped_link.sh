#!/usr/bin/env bash
# One device call on 2 GPUs: scripts/shaped_link.py over a real shaped veth (root, pyroute2 from
# .whl/), results (logs, summary.md, results.json) tarred into $OUT (or ./outputs/).
#   RATE=1gbit STEPS=1000 FLAVOR=small METHODS=adamw,flexdemo,diloco,demo_diloco \
#     ADAMW_LINK_STEPS=20 RUN_TIMEOUT=150 bash scripts/gpu_shaped_link.sh [-- extra torchtitan flags]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
RATE=${RATE:-1gbit}; STEPS=${STEPS:-1000}; FLAVOR=${FLAVOR:-small}
METHODS=${METHODS:-adamw,flexdemo,flexdemo_overlap,diloco,demo_diloco}
NAME=${NAME:-shaped_gpu_$RATE}
RES=/tmp/$NAME
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RES.gpus.txt"
python3 scripts/shaped_link.py --device gpu --rate "$RATE" --steps "$STEPS" --flavor "$FLAVOR" \
  --methods "$METHODS" --adamw-link-steps "${ADAMW_LINK_STEPS:-0}" --sync-interval "${SYNC:-32}" \
  --adamw-buckets "${ADAMW_BUCKETS:-4}" --timeout "${RUN_TIMEOUT:-600}" --out "$RES" "$@"
mv "$RES.gpus.txt" "$RES/gpus.txt"
tar czf "$OUT_DIR/$NAME.tgz" --exclude dumps -C /tmp "$NAME"
