#!/usr/bin/env bash
# Every plot on docs/results.md, drawn again from its data in docs/results/ (needs matplotlib):
#   bash benchmarks/plots.sh
# One plot.py call per line: tests/test_results_commands.py parses each like the page's commands.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 benchmarks/plot.py --csv docs/results/1b_convergence/runs.csv --out docs/plots/1b_convergence --runs adamw,adamw_seed2,flexdemo,flexdemo_seed2,diloco_h32,demo_diloco_h16,demo_diloco_h16_seed2 --target-runs adamw,adamw_seed2 --title "1B flavor, 2 replicas, 1024 steps, the same held-out batches at every validation"
python3 benchmarks/plot.py --shaped docs/results/link_small_1gbit --out docs/plots/link_small_1gbit --title "small flavor, 2 x H200, 1 Gbit/s tbf link, 1000 steps (diloco 1600)"
python3 benchmarks/plot.py --shaped docs/results/link_1b_1gbit --out docs/plots/link_1b_1gbit --title "1B flavor, 1 Gbit/s tbf link: step times on the link, curves off it, 1024 steps"
python3 benchmarks/plot.py --frontier docs/results/recipe_small/runs.csv --out docs/plots/recipe_small --title "small flavor, 1000 steps, per-step top-k sweep and demo_diloco"
python3 benchmarks/plot.py --frontier docs/results/recipe_1b/runs.csv --out docs/plots/recipe_1b --title "1B flavor, 1024 steps, lr 3e-4"
python3 benchmarks/plot.py --csv docs/results/small_convergence/runs.csv --out docs/plots/small_convergence --runs adamw_lr1e-3,adamw_lr1e-3_seed2,flexdemo,diloco_h32,demo_diloco_h32,demo_diloco_h32_seed2,demo_diloco_h32_top48_olr2 --target-runs adamw_lr1e-3,adamw_lr1e-3_seed2 --title "small flavor, 2 x H200, 1024 steps, H = 32, rolling held-out batches"
python3 benchmarks/plot.py --frontier docs/results/long_small_shared_h200/runs.csv --out docs/plots/long_small_shared_h200 --title "small flavor, 2 replicas sharing 1 x H200 (gloo), 3990 steps, 133 outer steps at H = 30" --same-bits sparseloco_olr3_ef_s1234=sparseloco_olr3_s1234:227325595 --same-bits sparseloco_olr3_ef_s4321=sparseloco_olr3_s4321:227325595 --same-bits sparseloco_olr3_ef_s5678=sparseloco_olr3_s5678:227325595 --same-bits sparseloco_olr3_h16_top32_ef_s5678=sparseloco_olr3_h16_top32_s5678:252888135
python3 benchmarks/plot.py --frontier docs/results/long_small_shared_h200/runs.csv --intervals --out docs/plots/long_small_shared_h200 --title "corpus 1, small, 3990 steps: each setting against AdamW over its seeds (1234 / 4321 / 5678), 95% intervals"
python3 benchmarks/plot.py --frontier docs/results/pysource2_frontier_h100/runs.csv --intervals --seeds 11 22 33 44 --out docs/plots/pysource2_frontier_h100 --title "corpus 2, small, 3990 steps, 1 x H100, seeds 11 / 22 / 33 / 44: vs AdamW lr 1e-3, 95% intervals"
