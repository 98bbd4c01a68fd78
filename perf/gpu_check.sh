#!/usr/bin/env bash
# The GPU check of docs/performance.md, on a GPU machine without network, in two calls that fit one
# 15-minute lease (after `bash perf/gpu_check_prepare.sh ...` here; each writes $OUT, default ./gpu_check_out):
#   PART=1 bash perf/gpu_check.sh   # Table 1; with the device tool: carry=[".gpucheck"], timeout_s=600
#   PART=4 bash perf/gpu_check.sh   # Table 4 (MiniLM); carry=[".gpucheck4"] (.gpucheck stays from the first call)
# Each part: (a) the chain from scratch through Snakemake on the GPU on all cores beside the
# authors' script (value_vectors.py / nlp_value_vectors.py, unchanged but for their downloads) on
# the same inputs, joined per head (Table 1: both variants, the corrected job's time and memory);
# (b) the same on the CPU alone (CUDA_VISIBLE_DEVICES=, both sides), all cores; (c) the chain on
# the CPU with --cores 2. EIGENSOLVERS=1 adds perf/bench.py eigensolvers (1,024 matrices).
# DEVICE=cpu rehearses it on a machine without a GPU: (a) then runs on the CPU, (b) is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpucheck
OUT=${OUT:-$PWD/gpu_check_out}
DEVICE=${DEVICE:-cuda}
PART=${PART:-1}
EIG_HEADS=${EIG_HEADS:-1024}            # matrices per eigensolver (fewer for a CPU rehearsal: JAX on the CPU is slow)
AUTHORS_PYTHON=${AUTHORS_PYTHON:-python3}  # an interpreter with the authors' imports (seaborn, torchvision, transformers)
mkdir -p "$OUT"
if ! python3 -c "import snakemake" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/wheels/*.whl
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src:$PWD/tools${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/machine.txt"
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "|", os.cpu_count(), "cores")
PY
(lscpu | grep -i 'model name'; uptime) | tee -a "$OUT/machine.txt"
if [ "${EIGENSOLVERS:-0}" = 1 ]; then
  timeout 180 python3 perf/bench.py eigensolvers --heads "$EIG_HEADS" --cpu-threads "$(nproc)" --out "$OUT/eigensolvers.json" 2>&1 | tee "$OUT/eigensolvers.txt" || echo "eigensolvers: stopped ($?)" | tee -a "$OUT/eigensolvers.txt"
fi
if [ "$PART" = 4 ]; then
  T=.gpucheck4
  [ -f "$T/minilm/model.safetensors" ] || gunzip -k "$T/minilm/model.safetensors.gz"
  side() {  # side_by_side.py for Table 4: NAME DEVICE CORES [extra arguments]
    local name=$1 device=$2 cores=$3; shift 3
    python3 perf/side_by_side.py --table 4 --authors-script "$T/nlp_value_vectors.py" --authors-python "$AUTHORS_PYTHON" \
      --wikitext "$T/text/wikitext-103/wiki.test.raw" --model-dir "$T/minilm" --resources-dir "$T" --device "$device" \
      --cores "$cores" --snakemake-args="--scheduler greedy" --workdir "/tmp/gpucheck4_$name" --out "$OUT/t4_$name.json" "$@" 2>&1 | tee "$OUT/t4_$name.txt"
  }
  stats() { ls /tmp/gpucheck4_"$1"/authors/nlp_value_vectors_outputs/*/statistics/head_level_stats.csv; }
else
  side() {  # side_by_side.py for Table 1: NAME DEVICE CORES [extra arguments]
    local name=$1 device=$2 cores=$3; shift 3
    python3 perf/side_by_side.py --authors-script "$G/value_vectors.py" --authors-python "$AUTHORS_PYTHON" \
      --weights "$G/assets/weights/timm/deit_tiny_patch16_224.safetensors" --resources-dir "$G/assets" \
      --image-folder "$G/assets/images/val100" --val-dir --device "$device" --cores "$cores" --snakemake-args="--scheduler greedy" \
      --configfile config/offline_deit_tiny.yaml --workdir "/tmp/gpucheck_$name" --out "$OUT/t1_$name.json" "$@" 2>&1 | tee "$OUT/t1_$name.txt"
  }
  stats() { ls /tmp/gpucheck_"$1"/authors/value_vectors_outputs/*/statistics/head_level_stats.csv; }
fi
targets=("results/table$PART.csv")
[ "$PART" = 1 ] && [ "$DEVICE" != cpu ] && targets+=(results/table1_corrected.csv)
# (a) on $DEVICE, all cores; (b) the CPU alone, all cores, authors' script on the CPU too; (c) the CPU, 2 cores
side main "$DEVICE" "$(nproc)" --targets "${targets[@]}"
if [ "$DEVICE" != cpu ]; then
  CUDA_VISIBLE_DEVICES= side cpu cpu "$(nproc)"
  CUDA_VISIBLE_DEVICES= side cpu2 cpu 2 --skip-authors --authors-stats "$(stats cpu)"
else
  side cpu2 cpu 2 --skip-authors --authors-stats "$(stats main)"
fi
python3 - "$OUT" "$PART" <<'PY' | tee "$OUT/summary_t$PART.txt"
import glob, json, os, sys
out, part = sys.argv[1], sys.argv[2]
for path in sorted(glob.glob(f"{out}/t{part}_*.json")):
    s = json.load(open(path))
    r = s["runs"][-1]
    print(f"{os.path.basename(path)}: {s['cores']} cores, chain {r['chain_seconds']:.1f} s, authors' script {r['authors_seconds']:.1f} s: {r['authors_seconds'] / r['chain_seconds']:.2f}x; Snakemake itself {r['snakemake_itself']:.1f} s")
    for job, j in sorted(r["chain_jobs"].items()):
        print(f"  {job}: {j['seconds']:.1f} s, {j['cpu_seconds']:.1f} CPU-s, peak RSS {j['max_rss_mb']:.0f} MB")
    a = s["per_head_agreement"]
    if a:
        print(f"  per head: {a['heads']} heads, {a['beyond']} beyond tolerance (1e-5; RBF CKA 1e-4); " + ", ".join(f"{m} {n} ({w:.1e})" for m, (n, w) in a["per_metric"].items()))
PY
