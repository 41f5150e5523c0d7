#!/usr/bin/env bash
# One device call for the per-step mode's speed (2 GPUs), results into $OUT (or ./outputs/step_bench):
#   1. one optimizer step on GPU 0: DeMo.step (fused, tf32x3 kernels, torch path) vs fused AdamW
#      vs a parameter copy, llama3-1B shapes, and GPU time per kernel of the DeMo rows
#      (scripts/bench_optimizer_step.py --profile; $OUT/profile/);
#   2. torchtitan runs, llama3 1B flavor, 2 replicas x 1 shard, flexdemo_pysource: AdamW-DDP,
#      FlexDeMo, FlexDeMo with overlap; then a summary table;
#   3. the size of the flexdemo_pysource corpus built on this machine.
#   STEPS=60 bash scripts/gpu_step_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/step_bench}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
STEPS=${STEPS:-60}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpus.txt"

echo "=== optimizer step (GPU 0)"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 scripts/bench_optimizer_step.py --json "$OUT_DIR/optimizer_step.json" \
  --profile "$OUT_DIR/profile" > "$OUT_DIR/optimizer_step.log" 2>&1
echo "exit $?"; tail -n 40 "$OUT_DIR/optimizer_step.log"

export NPROC=2 LOG_RANK=0,1
titan_1b_flags "$STEPS"
RUN_TIMEOUT=200 RUN_GREP="validate|Triton|Error|error"
titan_run ddp_adamw gpu_2gpu_ddp_adamw
titan_run flexdemo gpu_2gpu_flexdemo --optimizer.lr 3e-4
titan_run flexdemo_overlap gpu_2gpu_flexdemo --optimizer.lr 3e-4 --flexdemo.overlap
python3 scripts/summarize_titan_logs.py "$OUT_DIR"/{ddp_adamw,flexdemo,flexdemo_overlap}.log | tee "$OUT_DIR/summary.md"
python3 - <<'PY' | tee "$OUT_DIR/pysource_manifest.json"
import json
from flexdemo.data import ensure_assets, read_manifest
m = read_manifest(ensure_assets(corpus="pysource"))
print(json.dumps({k: v for k, v in m.items() if k != "sha256"}, indent=1))
PY
