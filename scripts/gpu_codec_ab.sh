#!/usr/bin/env bash
# One device call on a 4-GPU host (2 GPUs do without OUTER and VARIANTS_FILE): the codec kernels as
# they are against an older copy of the package (OLD_TREE, a folder holding flexdemo/:
# `mkdir .old_kernels && git archive <commit> flexdemo | tar -x -C .old_kernels`, listed in
# .git/info/exclude and carried to the device machine), side by side on the same card, then
# torchtitan throughput with the current kernels:
#   GPU 0:    scripts/bench_optimizer_step.py, old (if OLD_TREE is set) then new (PROFILE=1: with
#             --profile): old.json, new.json;
#   GPU 1:    the current kernels against the torch path on this card (bench_fused.py's check),
#             then the 8B shard's codec timing (bench_fused.py
#             --layers 32 --embeddings, issue 8's encode + decode against the memory floor), old
#             (if OLD_TREE is set) then new;
#   GPUs 0,1: then torchtitan 1B, 2 replicas x 1 shard, STEPS steps: AdamW-DDP, then the FlexDeMo
#             runs named in TITAN_RUNS (default "flexdemo flexdemo_overlap") and a summary table
#             (TITAN_RUNS=none: no torchtitan runs);
#   GPUs 2,3: from the start, OUTER=1: the outer step alone at top-k 32 and 256 (bench_diloco.py),
#             old then new; and/or recipe variants (VARIANTS_FILE, VARIANTS_ONLY, FLAVOR_VARIANTS,
#             STEPS_VARIANTS, VAL_FREQ_VARIANTS, VARIANT_TIMEOUT as in gpu_link_and_recipe.sh).
# Everything lands in /tmp/codec_ab, tarred into $OUT/codec_ab.tgz (a device call returns 8 files).
#   OLD_TREE=.old_kernels STEPS=80 OUTER=1 bash scripts/gpu_codec_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=/tmp/codec_ab; mkdir -p "$OUT_DIR" "${OUT:=outputs}"
source scripts/gpu_env.sh
OLD=${OLD_TREE:+$(cd "$OLD_TREE" && pwd)}; STEPS=${STEPS:-60}
need=2; [[ -n "${OUTER:-}${VARIANTS_FILE:-}" ]] && need=4  # GPUs 2,3 only for those
(( $(nvidia-smi -L | wc -l) >= need )) || { echo "needs $need GPUs" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT_DIR/gpus.txt"

(  # GPUs 2,3
  export CUDA_VISIBLE_DEVICES=2,3 NPROC=2 LOG_RANK=0,1
  if [[ -n "${OUTER:-}" ]]; then
    for tree in ${OLD:+old} new; do
      pp=$PYTHONPATH; [[ $tree == old ]] && pp="$OLD:$PYTHONPATH"
      PYTHONPATH=$pp timeout 200 torchrun --nproc_per_node 2 --master_port 29513 scripts/bench_diloco.py --flavor 1B \
        --topk 32,256 --configs topk:scaled_sign --no-host-state --syncs 3 --json "$OUT_DIR/outer_$tree.json" \
        > "$OUT_DIR/outer_$tree.log" 2>&1
      echo "=== outer step ($tree): exit $?"
    done
  fi
  if [[ -n "${VARIANTS_FILE:-}" ]]; then
    NAME=recipe OUT=$OUT_DIR FLAVOR=${FLAVOR_VARIANTS:-1B} STEPS=${STEPS_VARIANTS:-1024} \
      VAL_FREQ=${VAL_FREQ_VARIANTS:-128} CONCURRENT=1 DEVICES_PER_JOB=2 bash scripts/gpu_link_and_recipe.sh
  fi
) > "$OUT_DIR/gpus23.out" 2>&1 &

step_bench() {  # NAME [env...]: one bench_optimizer_step run on GPU 0
  local name=$1; shift
  env CUDA_VISIBLE_DEVICES=0 "$@" timeout 200 python3 scripts/bench_optimizer_step.py --json "$OUT_DIR/$name.json" \
    ${PROFILE_THIS:+--profile "$OUT_DIR/profile_$name"} > "$OUT_DIR/$name.log" 2>&1
  echo "=== $name: exit $?"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows']
for k, v in r.items(): print(f'{k:28s} {v[\"step_ms\"]:8.1f} ms')" "$OUT_DIR/$name.json"
}
(  # GPU 1: the new kernels against the torch path on the card (scripts/bench_fused.py's check)
  for prec in ieee tf32x3; do
    name=fused_check_$prec
    CUDA_VISIBLE_DEVICES=1 timeout 200 python3 scripts/bench_fused.py --device cuda \
      --layers 2 --iters 2 --no-torch --precision $prec --json "$OUT_DIR/$name.json" > "$OUT_DIR/$name.log" 2>&1
    echo "=== $name: exit $?"; grep -iE "verify|mismatch|diff" "$OUT_DIR/$name.log" | head -5
  done
  # the 8B shard (issue 8's codec target: encode + decode against the memory floor), old then new
  for run in ${OLD:+old} new; do
    pp=$PYTHONPATH; [[ $run == old ]] && pp="$OLD:$PYTHONPATH"
    CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$pp timeout 200 python3 scripts/bench_fused.py \
      --device cuda --layers 32 --embeddings --iters 5 --no-torch --precision tf32x3 --json "$OUT_DIR/shard8b_$run.json" \
      > "$OUT_DIR/shard8b_$run.log" 2>&1
    echo "=== shard8b_$run: exit $?"
  done
) > "$OUT_DIR/fused_check.out" 2>&1 &
CHECK_PID=$!
[[ -n "$OLD" ]] && step_bench old PYTHONPATH="$OLD:$PYTHONPATH"
PROFILE_THIS=${PROFILE:-} step_bench new
wait $CHECK_PID  # the fused check on GPU 1

if [[ "${TITAN_RUNS:-}" != none ]]; then
  export CUDA_VISIBLE_DEVICES=0,1 NPROC=2 LOG_RANK=0,1
  titan_1b_flags "$STEPS"
  RUN_TIMEOUT=${RUN_TIMEOUT:-200} RUN_GREP="Error|error"
  titan_run ddp_adamw gpu_2gpu_ddp_adamw
  logs=("$OUT_DIR/ddp_adamw.log")
  for name in ${TITAN_RUNS:-flexdemo flexdemo_overlap}; do
    flags=(--optimizer.lr 3e-4); [[ $name == *overlap* ]] && flags+=(--flexdemo.overlap)
    titan_run "$name" gpu_2gpu_flexdemo "${flags[@]}"
    logs+=("$OUT_DIR/$name.log")
  done
  python3 scripts/summarize_titan_logs.py "${logs[@]}" | tee "$OUT_DIR/summary.md"
fi
wait
cat "$OUT_DIR/fused_check.out" "$OUT_DIR/gpus23.out"
tar czf "$OUT/codec_ab.tgz" --exclude dumps -C /tmp codec_ab
