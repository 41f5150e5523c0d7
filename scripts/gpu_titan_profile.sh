#!/usr/bin/env bash
# One device call on 2 GPUs: torchtitan 1B, 2 replicas x 1 shard (seq 2048, local batch 4), STEPS
# steps of each run in RUNS (ddp_adamw, flexdemo, flexdemo_overlap; LAYOUT=2x2: on 4 GPUs, 2 replicas
# x 2 FSDP shards, the baseline AdamW-HSDP, traces of ranks 0 and 2) with torch.profiler on for
# steps PROFILE_AT-1 and PROFILE_AT (torchtitan's [profiling]), then scripts/titan_trace_summary.py
# on rank 0's trace: where a step's GPU time goes and where the GPU idles (PROFILE=0: no profiler,
# for tokens/s; the summary table either way). SYNC_DEBUG=1: each run also counts the host<->GPU
# syncs of every rank by Python stack (scripts/cuda_sync_debug/, sync_<run>/rank<R>.txt).
# Into $OUT/<basename of OUT_DIR, default titan_profile>.tgz.
#   STEPS=30 bash scripts/gpu_titan_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-/tmp/titan_profile}; mkdir -p "$OUT_DIR" "${OUT:=outputs}"
source scripts/gpu_env.sh
STEPS=${STEPS:-30}; AT=${PROFILE_AT:-25}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT_DIR/gpus.txt"
titan_layout "${LAYOUT:-2x1}"; export LOG_RANK=0
ranks=0; [[ "${LAYOUT:-2x1}" == 2x2 ]] && ranks="0 2"  # rank 2: the other replica
titan_1b_flags "$STEPS" 100000  # no held-out loss within the run
[[ "${PROFILE:-1}" != 0 ]] && COMMON+=(--profiling.enable_profiling --profiling.profile_freq "$AT"
                                       --profiling.profiler_warmup 3 --profiling.profiler_active 2)
RUN_TIMEOUT=${RUN_TIMEOUT:-200}
[[ "${SYNC_DEBUG:-0}" == 1 ]] && export PYTHONPATH="$PWD/scripts/cuda_sync_debug:$PYTHONPATH"
for name in ${RUNS:-ddp_adamw flexdemo flexdemo_overlap}; do
  export CUDA_SYNC_DEBUG_DIR="$OUT_DIR/sync_$name"
  titan_method "$name"
  for rank in $ranks; do
    trace=$(ls /tmp/runs/$name/profile_traces/iteration_*/rank${rank}_trace.json 2>/dev/null | tail -1)
    [[ -z "$trace" ]] && continue
    python3 scripts/titan_trace_summary.py "$trace" > "$OUT_DIR/trace_${name}_rank$rank.md" 2>&1
    gzip -c "$trace" > "$OUT_DIR/trace_${name}_rank$rank.json.gz"
    head -12 "$OUT_DIR/trace_${name}_rank$rank.md"
  done
done
python3 scripts/summarize_titan_logs.py "$OUT_DIR"/*.log | tee "$OUT_DIR/summary.md"
tar czf "$OUT/$(basename "$OUT_DIR").tgz" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")"
