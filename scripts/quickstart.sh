#!/usr/bin/env bash
# Set up and run the main job: a short FlexDeMo run, 2 replicas ("nodes") x 2 FSDP shards,
# on the embedded offline corpus. CPU (4 gloo processes) without a GPU; on GPUs the 2x2
# config with 4 GPUs, else the 2-GPU config (2 replicas x 1 shard); one GPU cannot hold
# two replicas, so there the CPU run is used with the GPU hidden.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [[ "$NGPU" -ge 4 ]]; then
  CONFIG=train_configs/gpu_4gpu_2x2_flexdemo.toml; export NPROC=4
elif [[ "$NGPU" -ge 2 ]]; then
  CONFIG=train_configs/gpu_2gpu_flexdemo.toml; export NPROC=2
else
  [[ "$NGPU" -eq 1 ]] && export CUDA_VISIBLE_DEVICES=""
  CONFIG=train_configs/cpu_2x2_flexdemo.toml
fi
exec bash scripts/launch.sh "$CONFIG" "$@"
