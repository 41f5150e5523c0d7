#!/usr/bin/env bash
# One device call: codec benchmarks on one GPU, JSON into $OUT (or ./outputs/codec_bench).
#   optimizer path (bench_codec.py): torch vs fused for sign, fused for scaled_sign / bf16 / fp32;
#   kernel level (bench_fused.py): per-tensor vs grouped launches, bitwise checks.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-outputs/codec_bench}"; mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
B="python3 scripts/bench_codec.py --device cuda --layers 32 --embeddings --iters 5"
$B --path torch --encoding sign --json "$OUT_DIR/codec_torch_sign.json" > /dev/null
for enc in sign scaled_sign bf16 fp32; do
  $B --path fused --encoding "$enc" --json "$OUT_DIR/codec_fused_$enc.json" > /dev/null
done
python3 scripts/bench_fused.py --device cuda --layers 32 --embeddings --iters 5 --json "$OUT_DIR/kernels.json" > "$OUT_DIR/kernels.txt" 2>&1
python3 - "$OUT_DIR" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1])
for f in sorted(d.glob("codec_*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem:22s} floor {r['floor_ms']:6.2f} ms  encode {r['encode_ms']:7.2f}  decode {r['decode_ms']:7.2f}  "
          f"(enc+dec)/floor {r['encode_plus_decode_over_floor']:6.1f}  fused buckets {r['fused_buckets']}/{r['buckets']}")
k = json.loads((d / "kernels.json").read_text())
print({key: v for key, v in k.items() if key.endswith("_ms") or key.startswith("verify_grouped")})
PY
