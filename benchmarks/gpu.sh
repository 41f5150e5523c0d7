#!/usr/bin/env bash
# The one entry point for measurements on a GPU machine (no internet needed):
#   bash benchmarks/gpu.sh SUITE [ARGS...]
# Results go to $OUT/SUITE/ (OUT defaults to outputs/) and are tarred into $OUT/SUITE.tgz; the
# card is recorded in gpus.txt beside them. Wheels found in .whl/ (git-ignored) are installed
# first, for machines without internet; fetch them elsewhere for Python 3.12 with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     torchtitan==0.2.2 tyro torchdata datasets tomli dill multiprocess docstring-parser typeguard \
#     shtab xxhash fsspec pyroute2
#
# Suites (benchmarks/README.md says what each measures):
#   codec                 encode/decode time per encoding, torch vs fused, and the kernels (1 GPU)
#   step [BASELINE_DIR]   one optimizer step at 1B shapes: DeMo vs fused AdamW; BASELINE_DIR: the
#                         same for an older flexdemo package (git archive REV flexdemo | tar -x -C DIR)
#   outer [ARGS]          the DiLoCo outer step alone, 2 GPUs; on 1 GPU one replica, the codec without the
#                         exchange (benchmarks/outer_step.py ARGS)
#   runs [ARGS]           torchtitan runs side by side with their held-out losses (benchmarks/runs.py);
#                         MPS=1: their processes share the GPU through CUDA MPS (start_mps below)
#   link [ARGS]           torchtitan runs over a real shaped link, 2 GPUs (benchmarks/shaped_link.py)
#   checks                GPU correctness: zero votes, start-up agreement, skipped steps, overlap's delayed
#                         update, host-memory momentum, replica check
#   profile [RUN...]      torch.profiler traces of 1B runs (adamw, flexdemo, flexdemo_overlap) and
#                         where each step's GPU time goes; LAYOUT=2x2 for 4 GPUs, STEPS (default 30)
#   elastic [ARGS]        4 elastic replicas on torchft (one GPU each, small): one killed and restarted;
#                         tokens/s before, during and after the outage, held-out loss against an
#                         uninterrupted run (benchmarks/elastic_outage.py ARGS; needs the torchft wheels)
#   large [PART...]       issue 35's large-model rows, 4 GPUs as 2 replicas x 2: 8b_long (per-step demo vs
#                         AdamW-HSDP, 300 steps, held-out loss), 8b_layouts (TP 2 vs FSDP 2 in a replica,
#                         the DiLoCo modes), 14b (qwen3 14B per mode, 30 steps); seq 4096, batch 1, full AC
#   corpus                the comparison corpus (pysource2) built from this machine's packages, timed, and its
#                         audit at 1, 2 and 4 data-parallel ranks of the comparison configs (corpus.txt);
#                         run first in a session: the training suites then find it in the cache
#   detach SUITE [ARGS] [+ SUITE [ARGS]]...  the suites one after another in the background, in a session
#                         of its own (it outlives this call while the machine stays warm), results in
#                         /tmp/detached/SUITE/
#   collect [SECONDS]     waits for the detached suites (default 540 s), then packs /tmp/detached into
#                         $OUT/collect/detached.tgz
#   watch [SECONDS]       progress of a detached `runs` every minute for SECONDS (default 540), then its
#                         logs packed into $OUT/watch/runs_logs.tgz (benchmarks/watch_runs.py)
set -uo pipefail
cd "$(dirname "$0")/.."
SUITE=${1:?usage: bash benchmarks/gpu.sh codec|step|outer|runs|link|checks|profile|elastic|large|corpus|detach|collect|watch [ARGS...]}
shift
R="${OUT:-outputs}/$SUITE"
mkdir -p "$R"
if compgen -G ".whl/*.whl" >/dev/null && [[ ! -f /tmp/site/.flexdemo_installed ]]; then
  # once per machine: detached jobs keep importing from /tmp/site while later calls run
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  touch /tmp/site/.flexdemo_installed
fi
[[ -d /tmp/site ]] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"  # torchrun
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$R/gpus.txt"
NGPU=$(nvidia-smi -L | wc -l)

# MPS=1 (runs): the jobs' processes share the GPU through a CUDA MPS control daemon, so kernels of
# different processes run side by side instead of taking turns in time slices (jobs sharing one GPU,
# --shared-gpu); started here and quit when the suite ends. The card's settings (compute mode) stay
# as they are. Where the daemon does not start or a CUDA client cannot use it, the runs go on without
# it; gpus.txt says which.
start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if command -v nvidia-cuda-mps-control > /dev/null && nvidia-cuda-mps-control -d \
      && timeout 120 python3 -c 'import torch; assert torch.ones(8, device="cuda").sum().item() == 8'; then
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    echo "MPS: on" | tee -a "$R/gpus.txt"
  else
    command -v nvidia-cuda-mps-control > /dev/null && echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "MPS: did not start; the processes take turns on the GPU" | tee -a "$R/gpus.txt"
  fi
}

# 1B comparisons: seq 2048, local batch 4, warm-up 10, logged every 5 steps.
TITAN_1B=(--model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4
          --lr_scheduler.warmup_steps 10 --metrics.log_freq 5)

case "$SUITE" in
codec)
  B=(python3 benchmarks/codec.py --device cuda --layers 32 --embeddings --iters 5)
  "${B[@]}" --path torch --encoding sign --json "$R/codec_torch_sign.json" > /dev/null
  for enc in sign scaled_sign bf16 fp32; do
    "${B[@]}" --path fused --encoding "$enc" --json "$R/codec_fused_$enc.json" > /dev/null
  done
  # two_bit runs on the torch path inside a fused optimizer; Elias-Fano indices between the kernels
  "${B[@]}" --path fused --encoding two_bit --json "$R/codec_fused_two_bit.json" > /dev/null
  "${B[@]}" --path fused --encoding sign --index-coding elias_fano --json "$R/codec_fused_sign_ef.json" > /dev/null
  python3 benchmarks/kernels.py --device cuda --layers 32 --embeddings --iters 5 --json "$R/kernels.json" \
    > "$R/kernels.txt" 2>&1
  python3 benchmarks/codec.py --summarize "$R"
  ;;
step)
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/optimizer_step.py --json "$R/step.json" | tee "$R/step.txt"
  if [[ -n "${1:-}" ]]; then
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$1:$PYTHONPATH" python3 benchmarks/optimizer_step.py \
      --json "$R/step_baseline.json" | tee "$R/step_baseline.txt"
  fi
  ;;
outer)
  timeout 540 torchrun --nproc_per_node $(( NGPU >= 2 ? 2 : 1 )) --master_port 29511 benchmarks/outer_step.py "$@" \
    --json "$R/outer_step.json" 2>&1 | tee "$R/outer_step.log" | grep -vi warning | tail -20
  ;;
runs)
  [[ ${MPS:-0} == 1 ]] && start_mps
  python3 benchmarks/runs.py --out "$R" "$@" 2>&1 | tail -20
  ;;
link)
  python3 benchmarks/shaped_link.py --device gpu --out "$R" "$@" 2>&1 | grep -v Warning | tail -20
  ;;
checks)
  echo "=== zero votes"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/check_zero_votes.py > "$R/zero_votes.json" 2> "$R/zero_votes.err"
  echo "exit $?"; head -c 600 "$R/zero_votes.json"; echo
  echo "=== start-up agreement (2 GPUs)"
  CUDA_VISIBLE_DEVICES=0,1 timeout 240 python3 benchmarks/check_agreement.py > "$R/agreement.txt" 2>&1
  echo "exit $?"; tail -8 "$R/agreement.txt"
  echo "=== skipped steps (2 GPUs)"
  CUDA_VISIBLE_DEVICES=0,1 timeout 240 torchrun --nproc_per_node 2 --master_port 29512 benchmarks/check_skip.py \
    > "$R/skip.txt" 2>&1
  echo "exit $?"; grep '^{' "$R/skip.txt" | tail -1
  echo "=== overlap == the hand-delayed update, fused sign path (2 GPUs)"
  CUDA_VISIBLE_DEVICES=0,1 timeout 240 torchrun --nproc_per_node 2 --master_port 29513 benchmarks/check_overlap.py \
    > "$R/overlap.txt" 2>&1
  echo "exit $?"; grep '^{' "$R/overlap.txt" | tail -1
  echo "=== DeMo's momentum in host memory: pinned, the same bits (1 GPU)"
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_momentum_offload.py -k cuda \
    > "$R/momentum_offload.txt" 2>&1
  echo "exit $?"; tail -2 "$R/momentum_offload.txt"
  echo "=== replica check cost"
  CUDA_VISIBLE_DEVICES=0 python3 benchmarks/replica_check.py --device cuda > "$R/replica_check.json" 2>&1
  echo "exit $?"; tail -3 "$R/replica_check.json"
  ;;
profile)
  if [[ ${LAYOUT:-2x1} == 2x2 ]]; then
    export CUDA_VISIBLE_DEVICES=0,1,2,3 NPROC=4; base=gpu_4gpu_2x2_hsdp_adamw flex=gpu_4gpu_2x2_flexdemo ranks="0 2"
  else
    export CUDA_VISIBLE_DEVICES=0,1 NPROC=2; base=gpu_2gpu_ddp_adamw flex=gpu_2gpu_flexdemo ranks=0
  fi
  export LOG_RANK=0
  STEPS=${STEPS:-30}; AT=$((STEPS - 5))
  for name in "${@:-adamw flexdemo flexdemo_overlap}"; do
    for run in $name; do
      case $run in
        adamw) flags=("train_configs/$base.toml") ;;
        flexdemo) flags=("train_configs/$flex.toml" --optimizer.lr 3e-4) ;;
        flexdemo_overlap) flags=("train_configs/$flex.toml" --optimizer.lr 3e-4 --flexdemo.overlap) ;;
        *) echo "unknown run $run (adamw, flexdemo, flexdemo_overlap)" >&2; exit 2 ;;
      esac
      echo "=== $run"
      timeout 240 bash scripts/launch.sh "${flags[@]}" "${TITAN_1B[@]}" --training.steps "$STEPS" \
        --profiling.enable_profiling --profiling.profile_freq "$AT" --profiling.profiler_warmup 3 \
        --profiling.profiler_active 2 --job.dump_folder "/tmp/runs/$run" > "$R/$run.log" 2>&1
      echo "exit $?"
      for rank in $ranks; do
        trace=$(ls /tmp/runs/$run/profile_traces/iteration_*/rank${rank}_trace.json 2>/dev/null | tail -1)
        [[ -z "$trace" ]] && continue
        python3 benchmarks/profiling/trace_summary.py "$trace" > "$R/trace_${run}_rank$rank.md" 2>&1
        head -12 "$R/trace_${run}_rank$rank.md"
      done
    done
  done
  python3 benchmarks/summarize_logs.py "$R"/*.log | tee "$R/summary.md"
  ;;
large)
  # The 8B templates on the offline corpus, 2 replicas x 2 FSDP shards, one job at a time on all 4 GPUs.
  L=(--training.dataset flexdemo_pysource --validation.dataset flexdemo_pysource_validation
     --model.hf_assets_path "''" --training.local_batch_size 1 --training.seq_len 4096
     --validation.local_batch_size 1 --validation.seq_len 4096 --validation.steps 10 --checkpoint.no-enable
     --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2
     --lr_scheduler.warmup_steps 30 --metrics.log_freq 10 --metrics.no-enable-tensorboard)
  Q="--model.name flexdemo_qwen3 --model.flavor 14B"
  DL="--flexdemo.mode diloco --flexdemo.outer_lr 0.7 --flexdemo.outer_momentum 0.9 --flexdemo.outer_nesterov
      --flexdemo.outer_value_encoding bf16"
  SHORT="--validation.no-enable --flexdemo.sync_interval 8"
  for part in "${@:-8b_long 8b_layouts 14b}"; do
    case $part in
      8b_long) v=("8b_demo multinode_llama3_8b_flexdemo" "8b_hsdp multinode_llama3_8b_hsdp_adamw")
               flags="--training.steps 300 --validation.freq 100"; t=560 ;;
      8b_layouts) v=("8b_demo_tp2 multinode_llama3_8b_flexdemo --parallelism.tensor_parallel_degree 2
                     --parallelism.data_parallel_shard_degree 1" "8b_demo_diloco multinode_llama3_8b_demo_diloco"
                     "8b_diloco multinode_llama3_8b_demo_diloco $DL")
                  flags="--training.steps 24 $SHORT"; t=300 ;;
      14b) v=("14b_demo multinode_llama3_8b_flexdemo $Q" "14b_hsdp multinode_llama3_8b_hsdp_adamw $Q"
              "14b_demo_diloco multinode_llama3_8b_demo_diloco $Q" "14b_diloco multinode_llama3_8b_demo_diloco $Q $DL
              --flexdemo.outer_state_device cpu")
           flags="--training.steps 32 $SHORT"; t=360 ;;
      *) echo "unknown part $part (8b_long, 8b_layouts, 14b)" >&2; exit 2 ;;
    esac
    python3 benchmarks/runs.py --out "$R/$part" --nproc 4 --concurrent 1 --timeout $t \
      --common "${L[*]} $flags" "${v[@]}" 2>&1 | tail -12
  done
  ;;
corpus)
  ( time python3 -m flexdemo.data --corpus pysource2 --verbose ) > "$R/build.txt" 2>&1
  tail -25 "$R/build.txt"
  for dp in 1 2 4; do
    echo "dp=$dp $(python3 -m flexdemo.data audit --config train_configs/gpu_2gpu_ddp_adamw.toml --dp $dp)"
  done | tee "$R/corpus.txt"
  ;;
detach)
  # SUITE [ARGS] [+ SUITE [ARGS]]...: one after another; /tmp/detached/done once all have ended
  # an earlier batch's table would tell `watch` this one had ended
  mkdir -p /tmp/detached && rm -f /tmp/detached/done /tmp/detached/*/variants.md
  OUT=/tmp/detached setsid nohup bash -c 'cmd=()
    for a in "$@" +; do
      if [[ $a == + ]]; then bash benchmarks/gpu.sh "${cmd[@]}"; cmd=(); else cmd+=("$a"); fi
    done
    touch /tmp/detached/done' _ "$@" > /tmp/detached/console.log 2>&1 < /dev/null &
  echo "detached: bash benchmarks/gpu.sh $* (pid $!; /tmp/detached/console.log)"
  exit 0
  ;;
collect)
  # Waits for detached suites (at most SECONDS), printing each active log's last step every minute;
  # then everything under /tmp/detached (logs, tables) is packed into $OUT/collect/detached.tgz.
  end=$((SECONDS + ${1:-540})); next=0
  while [[ ! -f /tmp/detached/done ]] && (( SECONDS < end )); do
    if (( SECONDS >= next )); then
      next=$((SECONDS + 60)); echo "--- $(date +%T)"
      find /tmp/detached -name '*.log' -mmin -1 | while read -r f; do
        echo "$f: $(grep -a ' step: ' "$f" | tail -1 | cut -c1-160)"; done
    fi
    sleep 5
  done
  [[ -f /tmp/detached/done ]] && echo "all detached suites ended" || echo "still running"
  tail -15 /tmp/detached/console.log
  tar czf "$R/detached.tgz" --exclude dumps -C /tmp/detached .
  exit 0
  ;;
watch)
  python3 benchmarks/watch_runs.py /tmp/detached/runs --seconds "${1:-540}" --out "$R"
  tail -5 /tmp/detached/console.log
  ;;
elastic)
  # torchft_lighthouse: a console script of the torchft wheel, in /tmp/site/bin after pip --target
  export PATH="/tmp/site/bin:$PATH"
  # the runs' logs outside $OUT (few files come back from a device); packed into $R/logs.tgz
  python3 benchmarks/elastic_outage.py --out "$R" --work outputs/elastic_runs "$@" 2>&1 | tail -40
  ;;
*)
  echo "unknown suite $SUITE: codec, step, outer, runs, link, checks, profile, elastic, large, corpus, detach, collect or watch" >&2; exit 2 ;;
esac
tar czf "${OUT:-outputs}/$SUITE.tgz" --exclude dumps -C "${OUT:-outputs}" "$SUITE"
