#!/usr/bin/env bash
# flexdemo launcher: torchrun's launcher + torchtitan 0.2.2, ranks running flexdemo.titan.run
# (through flexdemo.titan.launch: the config checked once, then torchrun in the same process).
#
#   scripts/launch.sh CONFIG.toml [--section.key value ...]
#
# Environment (all optional):
#   NPROC        processes on this node   (default: #GPUs; 4 on a CPU-only machine)
#   NNODES       number of nodes          (default 1)
#   NODE_RANK    this node's index        (default 0)
#   MASTER_ADDR  node 0's address         (default 127.0.0.1)
#   MASTER_PORT  rendezvous port          (default 29500)
#   LOG_RANK     local ranks whose output is shown, e.g. 0 or 0,1,2,3 (default 0)
#   MAX_RESTARTS torchrun restarts a failed job this many times; it resumes from the last
#                checkpoint (default 0; give every node the same value). With restarts the
#                nodes meet through torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT
#                (RDZV_ID names the job, default "flexdemo"; NODE_RANK is then not used)
#   IFNAME       bind the collectives' sockets (gloo, NCCL) to this network interface
#   LOCAL_ADDR   the address this node announces to the rendezvous (torchrun --local-addr)
#   LOG_DIR      also keep every local rank's full output in files under this dir
#                (torchrun --log-dir: LOG_DIR/<run id>/attempt_0/<local rank>/stdout.log)
#   FLEXDEMO_CACHE   the folder under which flexdemo's embedded corpus+tokenizer are built
#                    (one subfolder per corpus, Python and vocabulary), once, here, before
#                    torchrun, when the config needs them: its [model] hf_assets_path holds
#                    no tokenizer and it trains on one of flexdemo_stdlib / _pysource / _pysource2 (or
#                    names no path). A config's own tokenizer is always kept.
#                    Default: ~/.cache/flexdemo. (FLEXDEMO_ASSETS, the built folder itself,
#                    was removed: set FLEXDEMO_CACHE, or hf_assets_path to a folder built
#                    with `python -m flexdemo.data --out DIR`.)
#
# Without a GPU it runs on CPU with gloo (OMP_NUM_THREADS=1 unless set), the ranks forked from a
# process that has imported torch once (flexdemo.titan.launch says why).
set -euo pipefail

CONFIG=${1:?usage: scripts/launch.sh CONFIG.toml [--section.key value ...]}
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ -n "${IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME="$IFNAME" NCCL_SOCKET_IFNAME="$IFNAME"
fi

# Rendezvous: torchrun's static one keeps the workers' store for every attempt, so after a
# restart the new ranks read the dead ranks' gloo/NCCL addresses ("Connection refused";
# pytorch/pytorch#167288). Restarts therefore use the c10d rendezvous with a fresh workers' store
# per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE). Node order then follows arrival: each node
# still holds consecutive ranks, i.e. whole replicas.
if [[ "$MAX_RESTARTS" -gt 0 ]]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  RDZV=(--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-flexdemo}")
else
  RDZV=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
# One process per node: the config checked once (process count, validation for the final world
# size, the memory estimate, embedded assets built where needed; a bad config fails here, before
# any rank starts), then torchrun's launcher in the same process (flexdemo.titan.launch).
exec "$PYTHON" -m flexdemo.titan.launch \
  --nnodes "$NNODES" --max-restarts "$MAX_RESTARTS" "${RDZV[@]}" \
  ${LOCAL_ADDR:+--local-addr "$LOCAL_ADDR"} \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 ${LOG_DIR:+--log-dir "$LOG_DIR"} \
  -- "$CONFIG" "$@"
