#!/usr/bin/env bash
# The measurements of docs/performance.md, in order (about 12 minutes on a quiet 2-core CPU).
# Needs results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 (real DeiT-Tiny weights):
#   snakemake --cores 2 results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --configfile config/offline_deit_tiny.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
DEV=${DEV:-cpu}
OUT=perf/results
uptime | tee "$OUT/uptime_start_$DEV.txt"
python perf/bench_kpca.py stage results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --device "$DEV" --threads 2 --chunk 16 --out "$OUT/stage_deit_tiny_100_$DEV.json"
python perf/bench_kpca.py shapes --device "$DEV" --threads 2 --chunk 16 --out "$OUT/shapes_$DEV.json"
python perf/bench_kpca.py table1 --device "$DEV" --images 1 --threads 2 --chunk 16 --out "$OUT/table1_workload_1image_$DEV.json"
python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny.json"
uptime | tee "$OUT/uptime_end_$DEV.txt"
