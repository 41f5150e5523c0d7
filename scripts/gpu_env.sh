# Sourced (from the repo root) by the GPU scripts: the repo on PYTHONPATH, torchrun beside
# python3, and the wheels carried to a device machine without internet in .whl/ (git-ignored),
# fetched here for Python 3.12 with:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     torchtitan==0.2.2 tyro torchdata datasets tomli dill multiprocess docstring-parser typeguard shtab xxhash fsspec
# FD_GPU_ENV_READY: an outer script installed them already (two scripts at once would race).
if [[ -z "${FD_GPU_ENV_READY:-}" ]] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$(dirname "$(python3 -c 'import sys; print(sys.executable)')"):$PATH"
export FD_GPU_ENV_READY=1

# titan_1b_flags STEPS [VAL_FREQ]: into COMMON, the torchtitan flags the 1B throughput scripts share:
# llama3 1B, seq 2048, local batch 4, STEPS steps, warm-up 10, logged every 5 steps, the held-out
# loss (same seq and batch) every VAL_FREQ steps (default: at the last step).
titan_1b_flags() {
  local steps=$1 val=${2:-$1}
  COMMON=(--model.flavor 1B --training.seq_len 2048 --training.local_batch_size 4 --training.steps "$steps"
          --lr_scheduler.warmup_steps 10 --metrics.log_freq 5 --validation.freq "$val"
          --validation.seq_len 2048 --validation.local_batch_size 4)
}

# titan_layout 2x2|2x1: the GPUs and configs ($base, $flex) of the 1B comparisons: 4 GPUs as 2
# replicas x 2 FSDP shards (baseline AdamW-HSDP), or 2 GPUs as 2 replicas x 1 shard (AdamW-DDP).
titan_layout() {
  if [[ $1 == 2x2 ]]; then
    export CUDA_VISIBLE_DEVICES=0,1,2,3 NPROC=4; base=gpu_4gpu_2x2_hsdp_adamw flex=gpu_4gpu_2x2_flexdemo
  else
    export CUDA_VISIBLE_DEVICES=0,1 NPROC=2; base=gpu_2gpu_ddp_adamw flex=gpu_2gpu_flexdemo
  fi
}

# titan_method NAME: titan_run of one method of those comparisons, by name (a suffix _N repeats
# one): adamw or ddp_adamw (the baseline), flexdemo (lr 3e-4), flexdemo_overlap; else returns 2.
titan_method() {
  local name=$1
  case ${name%_[0-9]} in
    adamw|ddp_adamw) titan_run "$name" "$base" ;;
    flexdemo) titan_run "$name" "$flex" --optimizer.lr 3e-4 ;;
    flexdemo_overlap) titan_run "$name" "$flex" --optimizer.lr 3e-4 --flexdemo.overlap ;;
    *) echo "unknown run $name" >&2; return 2 ;;
  esac
  return 0  # a failed run is in its log; titan_run's own status is its grep's
}

# titan_run NAME CONFIG FLAGS...: one torchtitan run for the GPU bench scripts, with their
# COMMON flags, console into $OUT_DIR/NAME.log, capped at RUN_TIMEOUT s; prints the exit code
# and the log's last lines matching the final step or RUN_GREP.
titan_run() {
  local name=$1 cfg=$2; shift 2
  echo "=== $name ($STEPS steps)"
  timeout "${RUN_TIMEOUT:-240}" bash scripts/launch.sh "train_configs/$cfg.toml" "${COMMON[@]}" "$@" \
    --job.dump_folder "/tmp/runs/$name" > "$OUT_DIR/$name.log" 2>&1
  echo "exit $?"
  grep -E "step: *$STEPS |${RUN_GREP:-Error|error}" "$OUT_DIR/$name.log" | grep -v Warning | tail -5
}
