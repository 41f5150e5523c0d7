#!/usr/bin/env bash
# One device call on 2 GPUs, always ending with its results tarred into $OUT (or ./outputs/):
#   1. scripts/shaped_link.py runs LINK_METHODS over a real shaped veth (RATE), steps STEPS,
#      into /tmp/$NAME/link (capped at LINK_TIMEOUT s; LINK_ARGS: more shaped_link.py flags);
#   2. scripts/run_variants.py runs the recipe variants listed one per line in VARIANTS_FILE
#      (NAME CONFIG flags...), CONCURRENT at a time, off the link, into /tmp/$NAME/variants
#      (capped at VARIANT_TIMEOUT s each; DEVICES_PER_JOB > 0 gives each job its own GPUs);
#      VARIANTS_ONLY="name1 name2" keeps only those lines (a file split over several calls).
#   LINK_METHODS=diloco,flexdemo_overlap VARIANTS_FILE=scripts/recipe_small.txt \
#     bash scripts/gpu_link_and_recipe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
NAME=${NAME:-link_recipe}; RES=/tmp/$NAME; mkdir -p "$RES"
STEPS=${STEPS:-1000}; FLAVOR=${FLAVOR:-small}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$RES/gpus.txt"
if [[ -n "${LINK_METHODS:-}" ]]; then
  timeout "${LINK_TIMEOUT:-300}" python3 scripts/shaped_link.py --device gpu --rate "${RATE:-1gbit}" \
    --steps "$STEPS" --flavor "$FLAVOR" --methods "$LINK_METHODS" --sync-interval "${SYNC:-32}" \
    --timeout "${LINK_RUN_TIMEOUT:-200}" --out "$RES/link" ${LINK_ARGS:-} 2>&1 | grep -v Warning | tail -5
fi
if [[ -n "${VARIANTS_FILE:-}" ]]; then
  mapfile -t VARIANTS < <(grep -v '^\s*#' "$VARIANTS_FILE" | grep -v '^\s*$')
  if [[ -n "${VARIANTS_ONLY:-}" ]]; then
    KEPT=()
    for v in "${VARIANTS[@]}"; do [[ " $VARIANTS_ONLY " == *" ${v%% *} "* ]] && KEPT+=("$v"); done
    read -ra WANT <<< "$VARIANTS_ONLY"
    (( ${#KEPT[@]} == ${#WANT[@]} )) || { echo "VARIANTS_ONLY: not every name is a line of $VARIANTS_FILE" >&2; exit 2; }
    VARIANTS=("${KEPT[@]}")
  fi
  timeout "${VARIANTS_TOTAL_TIMEOUT:-300}" python3 scripts/run_variants.py --out "$RES/variants" \
    --concurrent "${CONCURRENT:-2}" --timeout "${VARIANT_TIMEOUT:-280}" --devices-per-job "${DEVICES_PER_JOB:-0}" \
    --common "--model.flavor $FLAVOR --training.steps $STEPS --validation.freq ${VAL_FREQ:-100}" "${VARIANTS[@]}" \
    2>&1 | tail -12
fi
tar czf "$OUT_DIR/$NAME.tgz" --exclude dumps -C /tmp "$NAME"
