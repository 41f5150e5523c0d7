#!/usr/bin/env bash
# Elastic replicas on CPU (torchft): three replicas, one killed and restarted; see
# scripts/elastic_demo.py for what the closing lines say.
#   bash scripts/elastic_demo.sh [--modes demo,demo_diloco] [--steps 150]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/elastic_demo.py "$@"
