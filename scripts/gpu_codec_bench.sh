#!/usr/bin/env bash
# One device call: codec benchmark on the GPU for every value encoding, JSON into $OUT (or ./outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs}"; mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/bench_codec.py --device cuda --layers 4 --iters 3 --profile > "$OUT_DIR/profile.txt" 2>&1 || cat "$OUT_DIR/profile.txt"
for enc in sign bf16 fp32; do
  python3 scripts/bench_codec.py --device cuda --layers 32 --embeddings --iters 5 --encoding "$enc" --json "$OUT_DIR/codec_cuda_$enc.json"
done
python3 scripts/bench_codec.py --device cuda --layers 32 --embeddings --iters 5 --encoding sign --tf32 --json "$OUT_DIR/codec_cuda_sign_tf32.json"
