#!/usr/bin/env bash
# One device call on a 4-GPU host, two jobs at once: the shaped link between GPUs 0 and 1
# (LINK_METHODS, RATE, SYNC, LINK_ARGS, ... as in gpu_link_and_recipe.sh) and recipe variants on
# GPUs 2,3 (VARIANTS_FILE, VARIANTS_ONLY, ...). The link's runs use sockets and the CPU, the
# variants NVLink between their own two GPUs, so neither slows the other's GPUs. Results:
# $OUT/${NAME}_link.tgz and $OUT/${NAME}_variants.tgz.
#   NAME=r3 RATE=1gbit LINK_METHODS=flexdemo,diloco VARIANTS_FILE=scripts/recipe_1b_round3.txt \
#     VARIANTS_ONLY=adamw_lr6e-4 FLAVOR_VARIANTS=1B STEPS_VARIANTS=1024 bash scripts/gpu_link_beside_variants.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
NAME=${NAME:-pair}
(( $(nvidia-smi -L | wc -l) >= 4 )) || { echo "needs 4 GPUs" >&2; exit 2; }
( export CUDA_VISIBLE_DEVICES=2,3 NPROC=2 NAME=${NAME}_variants FLAVOR=${FLAVOR_VARIANTS:-${FLAVOR:-small}} \
    STEPS=${STEPS_VARIANTS:-${STEPS:-1000}} VAL_FREQ=${VAL_FREQ_VARIANTS:-${VAL_FREQ:-100}}
  unset LINK_METHODS; bash scripts/gpu_link_and_recipe.sh ) > /tmp/${NAME}_variants.out 2>&1 &
( unset VARIANTS_FILE; NAME=${NAME}_link bash scripts/gpu_link_and_recipe.sh )
wait
cat /tmp/${NAME}_variants.out
