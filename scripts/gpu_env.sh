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
