#!/usr/bin/env bash
# The CPU measurements of docs/performance.md, as they were run: `bash perf/run_benchmarks.sh`
# for the 2026-11-22 stage measurements (about 15 minutes on a quiet 2-core CPU),
# `bash perf/run_benchmarks.sh chain` for the 2026-11-23 chain against the authors' code
# structure (about 15 minutes), `... amd`, `... intel3` and `... milan` for the later sessions' sections.
# Needs the real DeiT-Tiny activation file (and, for the chain's fidelity check, MiniLM's):
#   snakemake --cores 2 results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --configfile config/offline_deit_tiny.yaml
# and, for the chain's before/after comparisons, the code before the change in /tmp/base:
#   git archive 6deb9c2 | tar -x -C /tmp/base
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=perf/results
H5=results/activations/deit_tiny_patch16_224/vision_100_0of1.h5
uptime
if [ "${1:-stage}" = milan ]; then
  # the 2026-11-24 fourth-session check on an AMD EPYC (family 25, model 1) machine
  # (docs/performance.md, "Issue 18, fourth session"; about 7 minutes)
  for run in 1 2; do
    python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_milan_run$run.json"
    python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_milan_run$run.json"
  done
  python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_milan.txt" 2>&1
  uptime
  exit 0
fi
if [ "${1:-stage}" = intel3 ]; then
  # the 2026-11-24 third-session measurements on the Intel Xeon machine (docs/performance.md,
  # "Issue 18, third session"; about 20 minutes); /tmp/base: git archive 1fde9b1
  BEFORE=(--tree /tmp/base --configfile /tmp/base/config/offline_deit_tiny.yaml)
  for run in 1 2; do
    python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_intel3_run$run.json"
    python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_intel3_run$run.json"
    python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv "${BEFORE[@]}" --out "$OUT/chain_table1_deit_tiny_intel3_before_run$run.json"
  done
  python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny_intel3.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv "${BEFORE[@]}" --out "$OUT/chain_table1_corrected_deit_tiny_intel3_before.json"
  # per head, one worker (target 2): separate runs (before, now, before, now), then interleaved
  for run in 1 2; do
    (here=$PWD && cd /tmp/base && PYTHONPATH=/tmp/base/src python perf/bench_kpca.py stage "$here/$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$here/$OUT/stage_deit_tiny_100_intel3_breakdown_before_run$run.json")
    python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_intel3_breakdown_run$run.json"
  done
  python perf/bench_kpca.py ab "$H5" --tree /tmp/base --variant paper --out "$OUT/ab_paper_deit_tiny_intel3.json"
  python perf/bench_kpca.py ab "$H5" --tree /tmp/base --variant corrected --out "$OUT/ab_corrected_deit_tiny_intel3.json"
  # dry run of the default target (target 3): three with the check cache filled, three without
  for cache in filled empty; do
    for run in 1 2 3; do
      [ $cache = empty ] && rm -rf .snakemake/kpca_repro
      /usr/bin/time -f "$cache %e s" snakemake -n -q --configfile config/offline_deit_tiny.yaml config/offline_minilm.yaml 2>&1 >/dev/null | tail -1
    done
  done | tee "$OUT/dryrun_intel3.txt"
  python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_intel3.txt" 2>&1
  uptime
  exit 0
fi
if [ "${1:-stage}" = amd ]; then
  # the 2026-11-23 second-session measurements on the AMD EPYC machine (docs/performance.md,
  # "Issue 18 on the AMD EPYC machine"; about 25 minutes); /tmp/base: git archive 9232017
  BEFORE=(--tree /tmp/base --configfile /tmp/base/config/offline_deit_tiny.yaml)
  python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_amd_run1.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_amd_run1.json"
  cp config/offline_deit_tiny.yaml /tmp/offline_c16.yaml && printf '\nkpca:\n  heads_per_chunk: 16\n' >> /tmp/offline_c16.yaml
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --configfile /tmp/offline_c16.yaml --out "$OUT/chain_table1_deit_tiny_amd_chunk16.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv "${BEFORE[@]}" --out "$OUT/chain_table1_deit_tiny_amd_before_run1.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_amd_run2.json"
  python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_amd_run2.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv "${BEFORE[@]}" --out "$OUT/chain_table1_deit_tiny_amd_before_run2.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny_amd.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv "${BEFORE[@]}" --out "$OUT/chain_table1_corrected_deit_tiny_amd_before.json"
  # the two-worker stage: the authors' eigh threads against one, and by spin count
  GOMP_SPINCOUNT=3000 python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk 16 --eigh-threads auto --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_eigh_auto.json"
  GOMP_SPINCOUNT=3000 python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk 16 --eigh-threads 1 --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_eigh_1.json"
  for run in 1 2; do
    for c in 64 16; do
      GOMP_SPINCOUNT=3000 python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk $c --eigh-threads auto --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_chunk${c}_run$run.json"
    done
  done
  for c in 64 16; do
    GOMP_SPINCOUNT=3000 python perf/bench_kpca.py stage "$H5" --variants corrected --threads 2 --chunk $c --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_corrected_chunk$c.json"
  done
  for sc in 0 300 30000 300000; do
    GOMP_SPINCOUNT=$sc python perf/bench_kpca.py stage "$H5" --variants paper --threads 2 --chunk 16 --eigh-threads auto --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_spin$sc.json"
  done
  # per head, one worker: separate runs (before, now, before, now), then interleaved in one process
  for run in 1 2; do
    (here=$PWD && cd /tmp/base && PYTHONPATH=/tmp/base/src python perf/bench_kpca.py stage "$here/$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$here/$OUT/stage_deit_tiny_100_amd_breakdown_before_run$run.json")
    python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_amd_breakdown_run$run.json"
  done
  python perf/bench_kpca.py ab "$H5" --tree /tmp/base --variant paper --out "$OUT/ab_paper_deit_tiny_amd.json"
  python perf/bench_kpca.py ab "$H5" --tree /tmp/base --variant corrected --out "$OUT/ab_corrected_deit_tiny_amd.json"
  uptime
  exit 0
fi
if [ "${1:-stage}" = chain ]; then
  # alternating: the authors' structure, then the chain (on 2026-11-23 the third pair came
  # after the corrected and the before-change chains)
  for run in 1 2 3; do
    python perf/bench_kpca.py authors --out "$OUT/authors_deit_tiny_100_run$run.json"
    python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_run$run.json"
  done
  python perf/bench_kpca.py chain --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny.json"
  python perf/bench_kpca.py chain --cores 2 --targets results/table1.csv --tree /tmp/base --configfile /tmp/base/config/offline_deit_tiny.yaml --out "$OUT/chain_table1_deit_tiny_before_issue18.json"
  # per head: eigh, assignments and everything else, one and two worker threads
  python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_breakdown_1worker.json"
  python perf/bench_kpca.py stage "$H5" --variants paper corrected --threads 2 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_breakdown_2workers.json"
  # extraction images/s, this code against the code before; concurrent KPCA jobs by spin count
  python perf/bench_kpca.py extract --tree /tmp/base --repeats 5 --out "$OUT/extract_deit_tiny_100.json"
  python perf/bench_kpca.py concurrent "$H5" --layers 0 1 --spincounts 3000 default --out "$OUT/concurrent_kpca_deit_tiny_100.json"
  # per-head fidelity with the rule's settings
  python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_after_issue18.txt" 2>&1
  python perf/fidelity_check.py results/activations/sentence-transformers--all-MiniLM-L6-v2/text_100_0of1.h5 --layers 0,3,5 --inputs 20 > "$OUT/fidelity_minilm_after_issue18.txt" 2>&1
  uptime
  exit 0
fi
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
