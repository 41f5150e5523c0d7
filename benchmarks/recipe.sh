#!/usr/bin/env bash
# The compression-recipe sweep of docs/results.md section 1.5, on a 4-GPU machine:
#   bash benchmarks/recipe.sh codec         the new codecs' encode/decode time (one GPU)
#   bash benchmarks/recipe.sh grid SEED     per-step top-k x lr x decay, the encodings, AdamW (small)
#   bash benchmarks/recipe.sh dd SEED       demo_diloco settings aimed at >= 5000x fewer bytes (small)
#   bash benchmarks/recipe.sh pick SEED V…  named variants of grid/dd only (e.g. a second seed)
#   bash benchmarks/recipe.sh 1b SEED "NAME CONFIG FLAGS"…   1B, 1024 steps (section 1.1's setup)
# The small runs share GPUs (--jobs-per-slot): compare their losses, not their tokens/s.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the codec stage runs benchmarks/codec.py directly
STAGE=${1:?usage: bash benchmarks/recipe.sh codec|grid|dd|pick|1b [SEED] [VARIANT...]}
SEED=${2:-1234}
shift $(( $# < 2 ? $# : 2 ))

declare -A V=(
  [adamw]="gpu_2gpu_ddp_adamw --optimizer.lr 1e-3"
  [k32]="gpu_2gpu_flexdemo"
  [k4_s]="gpu_2gpu_flexdemo --flexdemo.topk 4 --optimizer.lr 5e-4"
  [k4]="gpu_2gpu_flexdemo --flexdemo.topk 4"
  [k4_l]="gpu_2gpu_flexdemo --flexdemo.topk 4 --optimizer.lr 2e-3"
  [k4_d995]="gpu_2gpu_flexdemo --flexdemo.topk 4 --flexdemo.decay 0.995"
  [k8_s]="gpu_2gpu_flexdemo --flexdemo.topk 8 --optimizer.lr 5e-4"
  [k8]="gpu_2gpu_flexdemo --flexdemo.topk 8"
  [k8_l]="gpu_2gpu_flexdemo --flexdemo.topk 8 --optimizer.lr 2e-3"
  [k8_d995]="gpu_2gpu_flexdemo --flexdemo.topk 8 --flexdemo.decay 0.995"
  [k16_s]="gpu_2gpu_flexdemo --flexdemo.topk 16 --optimizer.lr 5e-4"
  [k16]="gpu_2gpu_flexdemo --flexdemo.topk 16"
  [k16_l]="gpu_2gpu_flexdemo --flexdemo.topk 16 --optimizer.lr 2e-3"
  [k16_d995]="gpu_2gpu_flexdemo --flexdemo.topk 16 --flexdemo.decay 0.995"
  [k8_scaled]="gpu_2gpu_flexdemo --flexdemo.topk 8 --flexdemo.value_encoding scaled_sign"
  [k8_two_bit]="gpu_2gpu_flexdemo --flexdemo.topk 8 --flexdemo.value_encoding two_bit"
  [k8_ef]="gpu_2gpu_flexdemo --flexdemo.topk 8 --flexdemo.index_coding elias_fano"
  [k32_two_bit]="gpu_2gpu_flexdemo --flexdemo.value_encoding two_bit"
  [dd_h32_k64_ef]="gpu_2gpu_demo_diloco --flexdemo.outer_topk 64 --flexdemo.index_coding elias_fano"
  [dd_h16_k32_ef]="gpu_2gpu_demo_diloco --flexdemo.sync_interval 16 --flexdemo.outer_topk 32 --flexdemo.index_coding elias_fano"
  [dd_h64_k128_ef]="gpu_2gpu_demo_diloco --flexdemo.sync_interval 64 --flexdemo.outer_topk 128 --flexdemo.index_coding elias_fano"
  [dd_h32_k64_two_bit_ef]="gpu_2gpu_demo_diloco --flexdemo.outer_topk 64 --flexdemo.outer_value_encoding two_bit --flexdemo.index_coding elias_fano"
)
GRID=(adamw k4_s k4 k4_l k4_d995 k8_s k8 k8_l k8_d995 k16_s k16 k16_l k16_d995 k8_scaled k8_two_bit k8_ef)
DD=(dd_h32_k64_ef dd_h16_k32_ef dd_h64_k128_ef dd_h32_k64_two_bit_ef)

small() {  # the named variants, small flavor, 1000 steps, up to 8 jobs per GPU pair
  local specs=()
  for n in "$@"; do specs+=("${n}_s$SEED ${V[$n]:?unknown variant $n}"); done
  bash benchmarks/gpu.sh runs --nproc 2 --devices-per-job 2 --jobs-per-slot 8 --concurrent 16 --timeout 560 \
    --common "--model.flavor small --training.steps 1000 --validation.freq 250 --metrics.log_freq 50 --metrics.disable_color_printing --debug.seed $SEED" \
    "${specs[@]}"
}

case "$STAGE" in
codec)
  B=(python3 benchmarks/codec.py --device cuda --layers 32 --embeddings --iters 5 --path fused)
  mkdir -p "${OUT:-outputs}/codec"
  for spec in "sign fixed" "sign elias_fano" "two_bit fixed" "scaled_sign fixed"; do
    set -- $spec
    CUDA_VISIBLE_DEVICES=0 "${B[@]}" --encoding "$1" --index-coding "$2" \
      --json "${OUT:-outputs}/codec/codec_fused_$1_$2.json" > /dev/null || echo "codec $spec failed"
  done
  python3 benchmarks/codec.py --summarize "${OUT:-outputs}/codec"
  ;;
grid) small "${GRID[@]}" ;;
dd) small "${DD[@]}" ;;
pick) small "$@" ;;
1b)
  bash benchmarks/gpu.sh runs --nproc 2 --devices-per-job 2 --jobs-per-slot 2 --concurrent 4 --timeout 580 \
    --common "--model.flavor 1B --training.steps 1024 --validation.freq 128 --metrics.log_freq 16 --metrics.disable_color_printing --debug.seed $SEED" \
    "$@"
  ;;
*) echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
