#!/usr/bin/env bash
# One device call on one GPU: where the grouped encode spends its time (Nsight Compute, through
# scripts/gpu_ncu_encode.sh, one encode launch; NCU=0 skips it), then the llama3-8B shard's codec
# timing (bench_fused.py --layers 32 --embeddings, issue 8's encode + decode against the memory
# floor, with its check against the torch path first) under each launch setting in SETTINGS:
# "name:VAR=value,VAR=value name2:..." (environment settings; TREE=dir puts another copy of the
# package, dir/flexdemo, first on the path: `mkdir dir && git archive <commit> flexdemo | tar -x
# -C dir`, excluded from git and carried), one process per setting, in
# order, on the same card; then scripts/bench_optimizer_step.py (DeMo.step on 1.5 B parameters)
# under each of STEP_SETTINGS (same form; none by default). Everything is tarred into
# $OUT/encode_probe.tgz.
#   SETTINGS="default: old:TREE=.old_kernels" bash scripts/gpu_encode_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
mkdir -p "${OUT:=outputs}"
DIR=/tmp/encode_probe; mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$DIR/gpus.txt"
if [[ "${NCU:-1}" != 0 ]]; then
  OUT=$DIR/ncu KERNELS=_encode_many_kernel COUNT=1 timeout "${NCU_TIMEOUT:-240}" bash scripts/gpu_ncu_encode.sh \
    > "$DIR/ncu.out" 2>&1
  echo "=== ncu: exit $?"; tail -25 "$DIR/ncu.out"
  rm -f "$DIR/ncu/ncu_encode.ncu-rep"  # the text, raw and source pages hold what it says
fi
setting_env() {  # "name:VAR=v,VAR=v" -> the env arguments, TREE=dir as PYTHONPATH
  local vars=${1#*:} var; local -a out=()
  [[ -n "$vars" ]] && IFS=, read -ra vars_a <<< "$vars" && for var in "${vars_a[@]}"; do
    if [[ $var == TREE=* ]]; then out+=("PYTHONPATH=$(cd "${var#TREE=}" && pwd):$PYTHONPATH"); else out+=("$var"); fi
  done
  (( ${#out[@]} )) && printf '%s\n' "${out[@]}"
}
for setting in ${SETTINGS:-default:}; do
  name=${setting%%:*}; mapfile -t env_args < <(setting_env "$setting")
  env "${env_args[@]}" timeout "${RUN_TIMEOUT:-180}" python3 scripts/bench_fused.py --device cuda --layers 32 \
    --embeddings --iters 5 --no-torch --precision "${PRECISION:-tf32x3}" --json "$DIR/shard8b_$name.json" \
    > "$DIR/shard8b_$name.log" 2>&1
  echo "=== shard8b_$name (${setting#*:}): exit $?"
done
for setting in ${STEP_SETTINGS:-}; do
  name=${setting%%:*}; mapfile -t env_args < <(setting_env "$setting")
  env "${env_args[@]}" timeout "${RUN_TIMEOUT:-180}" python3 scripts/bench_optimizer_step.py \
    --json "$DIR/step_$name.json" > "$DIR/step_$name.log" 2>&1
  echo "=== step_$name (${setting#*:}): exit $?"
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows']
for k, v in r.items(): print(f'  {k:28s} {v[\"step_ms\"]:8.1f} ms')" "$DIR/step_$name.json"
done
python3 - "$DIR" <<'EOF'
import glob, json, os, sys
print(f"{'setting':24s} {'encode ms':>9s} {'decode ms':>9s} {'floor ms':>8s} {'ratio':>6s}  same sets  encode / decode regs/spills")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "shard8b_*.json"))):
    r = json.load(open(path))
    res = r.get("kernel_resources", {}).get("encode", [{}])[0]
    dec = r.get("kernel_resources", {}).get("decode", [{}])[0]
    v = r.get("verify", {})
    print(f"{os.path.basename(path)[8:-5]:24s} {r['encode_grouped_ms']:9.2f} {r['decode_grouped_ms']:9.2f} "
          f"{r['floor_ms']:8.2f} {r['grouped_encode_plus_decode_over_floor']:6.2f}  "
          f"{v.get('blocks_with_same_index_set')}/{v.get('blocks')}  {res.get('n_regs')}/{res.get('n_spills')}  {dec.get('n_regs')}/{dec.get('n_spills')}")
EOF
tar czf "$OUT/encode_probe.tgz" -C /tmp encode_probe
