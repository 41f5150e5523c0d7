#!/usr/bin/env bash
# One device call on 2 GPUs (2 replicas x 1 shard), results into $OUT (or ./outputs/diloco_bench):
#   1. the DiLoCo outer step alone (scripts/bench_diloco.py): time, GPU memory, bytes, exactness
#      checks, for dense/top-k and state on the GPU / in host memory;        (PART=outer)
#   2. torchtitan runs of the same model and data: AdamW-DDP, per-step FlexDeMo, DiLoCo and
#      DeMo-DiLoCo (state on the GPU, and in host memory), then a summary table.  (PART=titan)
#   PART=outer|titan|all STEPS=100 SYNC=25 FLAVOR=1B bash scripts/gpu_diloco_bench.sh
#   PART=outer OUTER_ARGS="--topk 32,64,128,256 --configs topk:scaled_sign --no-host-state" ...  (cost vs top-k)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/diloco_bench}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
PART=${PART:-all}; STEPS=${STEPS:-100}; SYNC=${SYNC:-25}; FLAVOR=${FLAVOR:-1B}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpus.txt"
export NPROC=2 LOG_RANK=0,1

if [[ "$PART" == outer || "$PART" == all ]]; then
  echo "=== outer step, $FLAVOR shapes"
  timeout 300 torchrun --nproc_per_node 2 --master_port 29511 scripts/bench_diloco.py --flavor "$FLAVOR" ${OUTER_ARGS:-} \
    --json "$OUT_DIR/outer_step.json" > "$OUT_DIR/outer_step.log" 2>&1
  echo "exit $?"; grep -E "Error|error" "$OUT_DIR/outer_step.log" | head -5
fi

if [[ "$PART" == titan || "$PART" == all ]]; then
  COMMON=(--model.flavor "$FLAVOR" --training.seq_len 2048 --training.local_batch_size 4
          --training.steps "$STEPS" --lr_scheduler.warmup_steps 20 --metrics.log_freq 5)
  RUN_TIMEOUT=240 RUN_GREP="outer step|Error|error"
  titan_run ddp_adamw gpu_2gpu_ddp_adamw
  titan_run flexdemo_demo gpu_2gpu_flexdemo --optimizer.lr 3e-4
  titan_run diloco gpu_2gpu_diloco --flexdemo.sync_interval "$SYNC" --flexdemo.replica_check_interval "$((4 * SYNC))"
  titan_run demo_diloco gpu_2gpu_demo_diloco --flexdemo.sync_interval "$SYNC" --flexdemo.replica_check_interval "$((4 * SYNC))"
  titan_run demo_diloco_host_state gpu_2gpu_demo_diloco --flexdemo.sync_interval "$SYNC" --flexdemo.replica_check_interval "$((4 * SYNC))" --flexdemo.outer_state_device cpu
  python3 scripts/summarize_titan_logs.py "$OUT_DIR"/{ddp_adamw,flexdemo_demo,diloco,demo_diloco,demo_diloco_host_state}.log \
    | tee "$OUT_DIR/summary.md"
fi
