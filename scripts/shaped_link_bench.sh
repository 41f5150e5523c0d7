#!/usr/bin/env bash
# A REAL slow link on one CPU machine (root): two "nodes" as network namespaces joined by a
# veth pair shaped with tc (token bucket, RATE each way). Each node runs 2 gloo ranks, so the
# 2 replicas x 2 shards configs put FSDP inside a node and the replica traffic on the link.
# Runs FlexDeMo and the AdamW-HSDP baseline for STEPS steps each; logs + summary in OUT_DIR.
#   RATE=50mbit STEPS=10 bash scripts/shaped_link_bench.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-50mbit}; STEPS=${STEPS:-10}
OUT_DIR=${OUT_DIR:-outputs/shaped_link_$RATE}; mkdir -p "$OUT_DIR"
NS=(fdnode0 fdnode1); IF=(fdlink0 fdlink1); IP=(10.77.0.1 10.77.0.2)

cleanup() { for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null; done; }
trap cleanup EXIT
cleanup
ip netns add "${NS[0]}" && ip netns add "${NS[1]}" || exit 1
ip link add "${IF[0]}" netns "${NS[0]}" type veth peer name "${IF[1]}" netns "${NS[1]}" || exit 1
for i in 0 1; do
  ip -n "${NS[$i]}" addr add "${IP[$i]}/24" dev "${IF[$i]}"
  ip -n "${NS[$i]}" link set lo up
  ip -n "${NS[$i]}" link set "${IF[$i]}" up
  ip netns exec "${NS[$i]}" tc qdisc add dev "${IF[$i]}" root tbf rate "$RATE" burst 64kbit latency 400ms || exit 1
done
python3 -m flexdemo.data >/dev/null  # build the data assets once, outside the namespaces

for cfg in cpu_2x2_flexdemo cpu_2x2_hsdp_adamw; do
  echo "=== $cfg over a $RATE link, $STEPS steps"
  start=$(date +%s)
  for i in 1 0; do
    ip netns exec "${NS[$i]}" env NNODES=2 NODE_RANK=$i NPROC=2 MASTER_ADDR="${IP[0]}" MASTER_PORT=29555 \
      GLOO_SOCKET_IFNAME="${IF[$i]}" LOG_RANK=0,1 \
      timeout 900 bash scripts/launch.sh "train_configs/$cfg.toml" --training.steps "$STEPS" \
      --flexdemo.replica_check_interval "$STEPS" --job.dump_folder "/tmp/shaped/$cfg/node$i" \
      > "$OUT_DIR/${cfg}_node$i.log" 2>&1 &
  done
  wait
  echo "wall $(( $(date +%s) - start )) s"
done
python3 scripts/summarize_titan_logs.py "$OUT_DIR"/*_node0.log | tee "$OUT_DIR/summary.md"
