#!/usr/bin/env bash
# GPU measurements of docs/performance.md (run on a CUDA machine; results under $OUT or perf/results).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-perf/results}
mkdir -p "$OUT"
THREADS=${THREADS:-$(( $(nproc) - 2 ))}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, scipy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'scipy', scipy.__version__)" | tee -a "$OUT/gpu.txt"
# the CUDA path against the CPU path on the same heads (CKA and flags; every column with fixed signs)
python - <<'PY' | tee -a "$OUT/gpu.txt"
import numpy as np, torch
from kpca_repro.method.kpca import head_metrics
gen = torch.Generator().manual_seed(0)
k = torch.randn(64, 197, 64, generator=gen) * 1.5 + torch.randn(64, 1, 64, generator=gen)
v = torch.randn(64, 197, 64, generator=gen)
base = torch.randn(64, 197, 64, generator=gen, dtype=torch.float64)
for variant in ("paper", "corrected"):
    kw = {"baseline": base} if variant == "corrected" else {}
    cpu = head_metrics(k, v, variant, **kw)
    gpu = head_metrics(k.cuda(), v.cuda(), variant, **{n: t.cuda() for n, t in kw.items()})
    cols = [c for c in cpu if cpu[c].dtype != bool]
    print(variant, "flags equal:", all(np.array_equal(cpu[c], gpu[c]) for c in cpu if cpu[c].dtype == bool),
          "max |cuda - cpu|:", {c: float(np.nanmax(np.abs(cpu[c] - gpu[c]))) for c in cols if c.endswith("cka") or variant == "corrected"})
PY
python perf/bench_shapes.py --device cuda --threads "$THREADS" --chunk 384 --baseline-heads 48 --out "$OUT/shapes_cuda.json"
# Table 1's workload: first 10 images per model (11,400 heads), then all 100 (114,000) if that was quick
python perf/bench_table1.py --device cuda --images 10 --threads "$THREADS" --chunk ${CHUNK:-512} --out "$OUT/table1_workload_10images_cuda.json"
if python -c "import json,sys; sys.exit(0 if json.load(open('$OUT/table1_workload_10images_cuda.json'))['total_seconds'] < 40 else 1)"; then
  python perf/bench_table1.py --device cuda --images 100 --threads "$THREADS" --chunk ${CHUNK:-512} --out "$OUT/table1_workload_100images_cuda.json"
fi
