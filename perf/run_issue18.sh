#!/usr/bin/env bash
# The 2026-11-23 measurements of docs/performance.md ("The Table 1 chain against the authors'
# code structure"): the same commands (on 2026-11-23 the third chain and authors runs came after
# the corrected and the before-change chains), about 15 minutes on a quiet 2-core CPU. Needs the real
# DeiT-Tiny activation file (and, for the fidelity check, MiniLM's):
#   snakemake --cores 2 results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --configfile config/offline_deit_tiny.yaml
# and, for the before/after comparisons, the code before the change in /tmp/base:
#   git archive 6deb9c2 | tar -x -C /tmp/base
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=perf/results
H5=results/activations/deit_tiny_patch16_224/vision_100_0of1.h5
uptime
# alternating: the authors' structure, then the chain
for run in 1 2 3; do
  python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_run$run.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_run$run.json"
done
python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny.json"
python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --tree /tmp/base --configfile /tmp/base/config/offline_deit_tiny.yaml --out "$OUT/chain_table1_deit_tiny_before_issue18.json"
# per head: eigh, assignments and everything else, one and two worker threads
python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_breakdown_1worker.json"
python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 2 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_breakdown_2workers.json"
# extraction images/s, this code against the code before
python perf/bench_kpca.py extract --tree /tmp/base --repeats 5 --out "$OUT/extract_deit_tiny_100.json"
# per-head fidelity with the rule's settings
python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_after_issue18.txt" 2>&1
python perf/fidelity_check.py results/activations/sentence-transformers--all-MiniLM-L6-v2/text_100_0of1.h5 --layers 0,3,5 --inputs 20 > "$OUT/fidelity_minilm_after_issue18.txt" 2>&1
uptime
