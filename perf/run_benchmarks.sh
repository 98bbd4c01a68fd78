#!/usr/bin/env bash
# The CPU measurements of docs/performance.md: `bash perf/run_benchmarks.sh KIND`, where KIND
# names the result files it writes to perf/results (one machine kind each):
#   intel3   the Intel Xeon (AVX-512) table: the chain against the authors' structure, the
#            per-head breakdown, the dry run and the fidelity check
#   amd      the AMD EPYC (AVX-512) table: the same chain and breakdown, and the two-worker
#            stage with the authors' eigh threads against one
#   milan    the AMD EPYC (AVX2 only) table: the chain and the fidelity check
#   extras   extraction throughput, two KPCA jobs on the same cores by GOMP_SPINCOUNT, and
#            the fidelity checks that docs/fidelity.md cites
#   memory   peak memory: ViT-Large (random weights) x 100 images, and glibc's settings on DeiT-Tiny
# Run it on a quiet machine; a rerun overwrites that kind's files (older ones stay in git).
# Needs the real DeiT-Tiny weights and images (../shared/assets) and the activation files:
#   snakemake --cores 2 --configfile config/offline_deit_tiny.yaml results/activations/deit_tiny_patch16_224/vision_100_0of1.h5
#   snakemake --cores 2 --configfile config/offline_minilm.yaml results/activations/sentence-transformers--all-MiniLM-L6-v2/text_100_0of1.h5   # extras only
# The GPU measurements: perf/run_gpu.sh and perf/run_gpu_table1.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=perf/results
H5=results/activations/deit_tiny_patch16_224/vision_100_0of1.h5
kind=${1:-}

chain_and_authors() {  # two alternating pairs: the authors' structure, then the paper chain
  for run in 1 2; do
    python perf/bench_authors.py --out "$OUT/authors_deit_tiny_100_$1_run$run.json"
    python perf/bench_chain.py --cores 2 --targets results/table1.csv --out "$OUT/chain_table1_deit_tiny_$1_run$run.json"
  done
}

breakdown() {  # per head, one worker, the rule's eigh threads: eigh, assignments and everything else
  for run in 1 2; do
    python perf/bench_stage.py "$H5" --variants paper corrected --threads 1 --chunk 64 --eigh-threads auto --skip-baseline --breakdown --out "$OUT/stage_deit_tiny_100_$1_breakdown_run$run.json"
  done
}

uptime
case "$kind" in
  intel3)
    chain_and_authors intel3
    python perf/bench_chain.py --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny_intel3.json"
    breakdown intel3
    # dry run of the default target: three with the check cache filled, three without it
    for cache in filled empty; do
      for run in 1 2 3; do
        [ $cache = empty ] && rm -rf .snakemake/kpca_repro
        /usr/bin/time -f "$cache %e s" snakemake -n -q --configfile config/offline_deit_tiny.yaml config/offline_minilm.yaml 2>&1 >/dev/null | tail -1
      done
    done | tee "$OUT/dryrun_intel3.txt"
    python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_intel3.txt" 2>&1
    ;;
  amd)
    chain_and_authors amd
    python perf/bench_chain.py --cores 2 --targets results/table1_corrected.csv --out "$OUT/chain_table1_corrected_deit_tiny_amd.json"
    # the two-worker stage as the rule runs it: the authors' eigh threads against one thread
    GOMP_SPINCOUNT=3000 python perf/bench_stage.py "$H5" --variants paper --threads 2 --chunk 16 --eigh-threads auto --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_eigh_auto.json"
    GOMP_SPINCOUNT=3000 python perf/bench_stage.py "$H5" --variants paper --threads 2 --chunk 16 --eigh-threads 1 --skip-baseline --out "$OUT/stage_deit_tiny_100_amd_2workers_eigh_1.json"
    breakdown amd
    ;;
  milan)
    chain_and_authors milan
    python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_milan.txt" 2>&1
    ;;
  extras)
    python perf/bench_extract.py --repeats 5 --out "$OUT/extract_deit_tiny_100.json"
    python perf/bench_concurrent.py "$H5" --layers 0 1 --spincounts 3000 default --out "$OUT/concurrent_kpca_deit_tiny_100.json"
    python perf/fidelity_check.py "$H5" --layers 0,5,9,11 --inputs 25 > "$OUT/fidelity_deit_tiny_after_issue18.txt" 2>&1
    python perf/fidelity_check.py results/activations/sentence-transformers--all-MiniLM-L6-v2/text_100_0of1.h5 --layers 0,3,5 --inputs 20 > "$OUT/fidelity_minilm_after_issue18.txt" 2>&1
    ;;
  memory)
    python perf/bench_memory.py --model vit_large_patch16_224 --images 4 100 --kpca-layers 0 1 2 3 --threads 2 --out "$OUT/memory_vit_large.json"
    python perf/bench_memory.py --model vit_large_patch16_224 --images 100 --threads 2 --out "$OUT/memory_vit_large_100_all_layers.json"
    python perf/bench_allocator.py "$H5" --layers 1 12 --threads 2 --out "$OUT/allocator_deit_tiny_100.json"
    ;;
  *)
    echo "usage: bash perf/run_benchmarks.sh intel3|amd|milan|extras|memory" >&2
    exit 2
    ;;
esac
uptime
