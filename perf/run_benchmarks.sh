#!/usr/bin/env bash
# The CPU measurements of docs/performance.md, as they were run (about 15 minutes on a quiet
# 2-core CPU). Needs results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 (real DeiT-Tiny):
#   snakemake --cores 2 results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --configfile config/offline_deit_tiny.yaml
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=perf/results
H5=results/activations/deit_tiny_patch16_224/vision_100_0of1.h5
uptime
python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk 16 --out "$OUT/stage_deit_tiny_100_cpu_paper.json"
python perf/bench_kpca.py stage "$H5" --variants corrected --baseline-threads 1 --threads 2 --chunk 16 --out "$OUT/stage_deit_tiny_100_cpu_corrected.json"
python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny.json"
python perf/bench_kpca.py shapes --threads 2 --chunk 16 --baseline-threads 1 --baseline-heads 24 --out "$OUT/shapes_cpu.json"
python perf/bench_kpca.py table1 --images 1 --threads 2 --chunk 16 --out "$OUT/table1_workload_1image_cpu.json"
# where the worker threads spend their time (eigh, assignments, the rest), real heads and random ones
python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk 16 --baseline-threads 1 --breakdown --out "$OUT/stage_deit_tiny_100_cpu_paper_breakdown.json"
python perf/bench_kpca.py table1 --images 1 --threads 2 --chunk 16 --breakdown --out "$OUT/table1_workload_1image_cpu_breakdown.json"
# host memory over depth: held memory or memory glibc keeps after free?
python perf/bench_kpca.py allocator "$H5" --layers 1 12 --threads 2 --out "$OUT/allocator_deit_tiny_100.json"
uptime
