#!/usr/bin/env bash
# One device call: torchtitan llama3 1B, the AdamW baseline then FlexDeMo (overlap off, then on),
# same steps, data and seed: on 4 GPUs the 2x2 configs (2 replicas x 2 FSDP shards, baseline
# AdamW-HSDP), on 2 GPUs the 2x1 ones (baseline AdamW-DDP). seq 2048, local batch 4, warm-up 10,
# logged every 5 steps, held-out loss at the last step. Logs and a summary into
# /tmp/titan_bench, tarred into $OUT/titan_bench.tgz. RUNS picks and orders the runs (a suffix _N
# repeats one: RUNS="flexdemo adamw flexdemo_2").
#   STEPS=100 bash scripts/gpu_titan_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=/tmp/titan_bench; mkdir -p "$OUT_DIR" "${OUT:=outputs}"
source scripts/gpu_env.sh
STEPS=${STEPS:-100}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpus.txt"
if (( $(nvidia-smi -L | wc -l) >= 4 )); then
  titan_layout 2x2; export LOG_RANK=0,1,2,3
else
  titan_layout 2x1; export LOG_RANK=0,1
fi
titan_1b_flags "$STEPS"
RUN_TIMEOUT=${RUN_TIMEOUT:-200} RUN_GREP="Error|error"
logs=()
for name in ${RUNS:-adamw flexdemo flexdemo_overlap}; do
  titan_method "$name" || exit 2
  logs+=("$OUT_DIR/$name.log")
done
python3 scripts/summarize_titan_logs.py "${logs[@]}" | tee "$OUT_DIR/summary.md"
tar czf "$OUT/titan_bench.tgz" -C /tmp titan_bench
