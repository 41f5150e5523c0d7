#!/usr/bin/env bash
# One device call: the 2x2 FlexDeMo config against its AdamW-HSDP baseline on 4 GPUs
# (same steps, data and seed), logs and a summary into $OUT (or ./outputs/titan_bench).
#   STEPS=150 bash scripts/gpu_titan_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/titan_bench}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
STEPS=${STEPS:-150}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT_DIR/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)
if [[ "$NGPU" -ge 4 ]]; then
  PAIR=(gpu_4gpu_2x2_flexdemo gpu_4gpu_2x2_hsdp_adamw); export NPROC=4
else
  PAIR=(gpu_2gpu_flexdemo gpu_2gpu_ddp_adamw); export NPROC=2
fi
export LOG_RANK=0,1,2,3
for cfg in "${PAIR[@]}"; do
  echo "=== $cfg ($STEPS steps)"
  timeout 280 bash scripts/launch.sh "train_configs/$cfg.toml" --training.steps "$STEPS" \
    --metrics.log_freq 10 --job.dump_folder "/tmp/runs/$cfg" > "$OUT_DIR/$cfg.log" 2>&1
  echo "exit $?"
  grep -E "step: *$STEPS |flexdemo step: *$STEPS |Error|error" "$OUT_DIR/$cfg.log" | grep -v Warning | head -12
done
python3 scripts/summarize_titan_logs.py "$OUT_DIR"/*.log | tee "$OUT_DIR/summary.md"
