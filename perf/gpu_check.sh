#!/usr/bin/env bash
# The GPU check of docs/performance.md, one command on a GPU machine without network:
#   bash perf/gpu_check.sh            # after `bash perf/gpu_check_prepare.sh ...` here; writes $OUT (default ./gpu_check_out)
# With the device tool: run(command="OUT=$OUT bash perf/gpu_check.sh", carry=[".gpucheck"], timeout_s=600).
# (a) the Table 1 chain (both variants) from scratch through Snakemake on the GPU, (b) the authors'
# value_vectors.py, unchanged but for its weights download, on the same 100 images, (c) the per-head
# comparison of the two, (d) the eigensolvers' throughput and agreement; then one short summary.
# On a machine without a GPU, DEVICE=cpu rehearses it (what this project's CI machines can run).
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpucheck
OUT=${OUT:-$PWD/gpu_check_out}
DEVICE=${DEVICE:-cuda}
EIG_HEADS=${EIG_HEADS:-1024}            # matrices per eigensolver (fewer for a CPU rehearsal: JAX on the CPU is slow)
AUTHORS_PYTHON=${AUTHORS_PYTHON:-python3}  # an interpreter with the authors' imports (seaborn, torchvision)
mkdir -p "$OUT"
if ! python3 -c "import snakemake" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$G"/wheels/*.whl
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/machine.txt"
import os, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "|", os.cpu_count(), "cores")
PY
# (d) 1,024 Table 1-shaped matrices through every solver that runs here
timeout 180 python3 perf/bench.py eigensolvers --heads "$EIG_HEADS" --cpu-threads "$(nproc)" --out "$OUT/eigensolvers.json" 2>&1 | tee "$OUT/eigensolvers.txt" || echo "eigensolvers: stopped ($?)" | tee -a "$OUT/eigensolvers.txt"
# (a)-(c): the chain from scratch and the authors' script, side by side, and the per-head join
python3 perf/side_by_side.py --authors-script "$G/value_vectors.py" --authors-python "$AUTHORS_PYTHON" \
  --weights "$G/assets/weights/timm/deit_tiny_patch16_224.safetensors" --resources-dir "$G/assets" \
  --image-folder "$G/assets/images/val100" --val-dir --device "$DEVICE" --cores "$(nproc)" \
  --targets results/table1.csv results/table1_corrected.csv --snakemake-args="--scheduler greedy" \
  --configfile config/offline_deit_tiny.yaml --workdir /tmp/gpucheck --out "$OUT/side_by_side.json" 2>&1 | tee "$OUT/side_by_side.txt"
cp /tmp/gpucheck/chain/results/table1.csv "$OUT/table1.csv"
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/side_by_side.json"))
r = s["runs"][-1]
print(f"chain {r['chain_seconds']:.1f} s, authors' script {r['authors_seconds']:.1f} s: {r['authors_seconds'] / r['chain_seconds']:.2f}x; Snakemake itself {r['snakemake_itself']:.1f} s")
for job, j in sorted(r["chain_jobs"].items()):
    print(f"  {job}: {j['seconds']:.1f} s, peak RSS {j['max_rss_mb']:.0f} MB")
a = s["per_head_agreement"]
print(f"per head: {a['heads']} heads, {a['beyond']} beyond tolerance (1e-5; RBF CKA 1e-4)")
for m, (n, worst) in a["per_metric"].items():
    print(f"  {m}: {n} beyond, max |difference| {worst:.1e}")
PY
# (e) the same machine's CPU cores alone (issue 44: device cpu on 16 cores no slower than on 2, and
# against the authors' script on the CPU: CUDA_VISIBLE_DEVICES hides the GPU from both sides)
if [ "${CPU_PART:-1}" = 1 ] && [ "$DEVICE" != cpu ]; then
  CUDA_VISIBLE_DEVICES= python3 perf/side_by_side.py --authors-script "$G/value_vectors.py" --authors-python "$AUTHORS_PYTHON" \
    --weights "$G/assets/weights/timm/deit_tiny_patch16_224.safetensors" --resources-dir "$G/assets" \
    --image-folder "$G/assets/images/val100" --val-dir --device cpu --cores "$(nproc)" \
    --targets results/table1.csv --snakemake-args="--scheduler greedy" \
    --configfile config/offline_deit_tiny.yaml --workdir /tmp/gpucheck_cpu --out "$OUT/side_by_side_cpu.json" 2>&1 | tee "$OUT/side_by_side_cpu.txt"
  CUDA_VISIBLE_DEVICES= python3 perf/side_by_side.py --skip-authors --authors-stats "$(ls /tmp/gpucheck_cpu/authors/value_vectors_outputs/*/statistics/head_level_stats.csv)" \
    --weights "$G/assets/weights/timm/deit_tiny_patch16_224.safetensors" --resources-dir "$G/assets" \
    --image-folder "$G/assets/images/val100" --val-dir --device cpu --cores 2 \
    --targets results/table1.csv --snakemake-args="--scheduler greedy" \
    --configfile config/offline_deit_tiny.yaml --workdir /tmp/gpucheck_cpu2 --out "$OUT/side_by_side_cpu_2cores.json" 2>&1 | tee "$OUT/side_by_side_cpu_2cores.txt"
fi
