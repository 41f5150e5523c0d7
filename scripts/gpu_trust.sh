#!/usr/bin/env bash
# One device call for the trust checks (4 GPUs: the 1B run on GPUs 0,1 beside the checks on 2,3;
# 2 GPUs: one after the other), results tarred into $OUT/trust.tgz:
#   1. scripts/gpu_zero_votes.py: zero casts no vote on the fused and torch paths (1000 steps,
#      every encoding), fused vs torch on partial blocks;
#   2. scripts/gpu_agreement_check.py (torchrun, 2 GPUs, NCCL): replicas that differ in the decode
#      path or the kernel precision refuse to start with one line naming it;
#   3. scripts/bench_replica_check.py: the replica check's cost over 1.5 B parameters;
#   4. scripts/bench_optimizer_step.py: DeMo.step now and at OLD_TREE (a copy of an older flexdemo
#      package, e.g. `git archive <commit> flexdemo | tar -x -C .old_tree`), side by side;
#   5. RUN_1B=1: the 1B per-step config, 1024 steps, held-out loss every 128 (lr 3e-4, seed 1234).
#   RUN_1B=1 OLD_TREE=.old_tree bash scripts/gpu_trust.sh
set -uo pipefail
cd "$(dirname "$0")/.."
R=/tmp/trust; mkdir -p "$R" "${OUT:=outputs}"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)
run_1b() {
  CUDA_VISIBLE_DEVICES=0,1 NPROC=2 MASTER_PORT=29631 timeout "${RUN_1B_TIMEOUT:-540}" bash scripts/launch.sh \
    train_configs/gpu_2gpu_flexdemo.toml --model.flavor 1B --training.steps 1024 --validation.freq 128 \
    --optimizer.lr 3e-4 --job.dump_folder /tmp/runs/flexdemo_1b > "$R/flexdemo_1b.log" 2>&1
  echo "exit $?" >> "$R/flexdemo_1b.log"
}
if [[ ${RUN_1B:-0} == 1 && $NGPU -ge 4 ]]; then run_1b & CHECK=2,3; else CHECK=0,1; fi
FIRST=${CHECK%%,*}
echo "=== zero votes"; CUDA_VISIBLE_DEVICES=$FIRST python3 scripts/gpu_zero_votes.py > "$R/zero_votes.json" 2> "$R/zero_votes.err"
echo "exit $?"; head -c 600 "$R/zero_votes.json"; echo
echo "=== agreement"; CUDA_VISIBLE_DEVICES=$CHECK timeout 240 python3 scripts/gpu_agreement_check.py > "$R/agreement.txt" 2>&1
echo "exit $?"; tail -8 "$R/agreement.txt"
echo "=== replica check"; CUDA_VISIBLE_DEVICES=$FIRST python3 scripts/bench_replica_check.py --device cuda > "$R/replica_check.json" 2>&1
echo "exit $?"; tail -3 "$R/replica_check.json"
echo "=== DeMo.step"
CUDA_VISIBLE_DEVICES=$FIRST python3 scripts/bench_optimizer_step.py --json "$R/step_new.json" > "$R/step_new.txt" 2>&1
tail -8 "$R/step_new.txt"
if [[ -n "${OLD_TREE:-}" ]]; then
  CUDA_VISIBLE_DEVICES=$FIRST PYTHONPATH="$OLD_TREE:$PYTHONPATH" python3 scripts/bench_optimizer_step.py \
    --json "$R/step_old.json" > "$R/step_old.txt" 2>&1
  tail -8 "$R/step_old.txt"
fi
if [[ ${RUN_1B:-0} == 1 && $NGPU -lt 4 ]]; then run_1b; fi
wait
grep -E "validate step|exit " "$R/flexdemo_1b.log" 2>/dev/null | tail -10
tar czf "$OUT/trust.tgz" -C /tmp trust
