#!/usr/bin/env bash
# Nsight Compute on one GPU (Firecracker machines read the counters; leave the clocks alone):
# where the grouped encode kernel and the grouped mean decode spend their time, on two layers of
# the llama3-8B shard (bench_fused.py's tensors): the first COUNT (2) launches whose name matches
# KERNELS (both kernels; KERNELS=_encode_many_kernel COUNT=1: one encode). Writes $OUT/ncu_encode.txt
# (the details page: throughput, occupancy, warp-state stall reasons, source counters) and
# $OUT/ncu_encode.ncu-rep, all metrics (ncu_encode_raw.csv) and per-SASS-line counters
# (ncu_encode_source.csv).
#   bash scripts/gpu_ncu_encode.sh            # PRECISION=ieee for the CUDA-core products
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
mkdir -p "${OUT:=outputs}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[[ -n "$NCU" ]] || { echo "no ncu on this machine" >&2; exit 2; }
# SETS="--set full" for every section (more replays); KERNELS / COUNT: which launches.
SETS=${SETS:---section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats --section SourceCounters}
"$NCU" --clock-control none $SETS --import-source yes \
  -k "regex:${KERNELS:-_encode_many_kernel|_mean_decode_many_kernel}" -c "${COUNT:-2}" -f -o "$OUT/ncu_encode" \
  python3 scripts/bench_fused.py --device cuda --layers 2 --iters 1 --no-torch \
  --precision "${PRECISION:-tf32x3}" > "$OUT/ncu_run.log" 2>&1
echo "ncu exit $?"; tail -3 "$OUT/ncu_run.log"
"$NCU" --import "$OUT/ncu_encode.ncu-rep" --page details > "$OUT/ncu_encode.txt" 2>&1
"$NCU" --import "$OUT/ncu_encode.ncu-rep" --page raw --csv > "$OUT/ncu_encode_raw.csv" 2>&1
"$NCU" --import "$OUT/ncu_encode.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_encode_source.csv" 2>&1
grep -iE "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Stall" \
  "$OUT/ncu_encode.txt" | head -40
