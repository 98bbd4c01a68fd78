"""Table 1's whole KPCA workload on random values: the batched method over 10 models x ``--images`` images.

    python perf/bench_table1.py [--images 1] [--device cuda] [--threads 14] [--chunk 16]
                                [--eigh-device cpu] [--streams] [--breakdown] [--out table1.json]

For each of Table 1's ten models (:data:`TABLE1_MODELS`; 1,140 heads per image), the paper
variant's batched method (perf/_methods.py) on random heads of the model's shape, in its own
process: seconds, heads/s, peak RSS (and GPU memory); ``--eigh-device cpu`` solves on the CPU
beside a GPU, ``--streams`` gives each worker thread its own CUDA stream, ``--breakdown`` splits
the worker threads' time. Writes ``{"command": "table1", ..., "total_heads", "total_seconds",
"rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import _bench
import _methods

from kpca_repro.method.variant import PAPER

#: Table 1's ten models: (tokens, head dim, layers, heads per layer); 1,140 heads per image.
TABLE1_MODELS = {
    "vit_tiny_patch16_224": (197, 64, 12, 3),
    "vit_small_patch16_224": (197, 64, 12, 6),
    "vit_base_patch16_224": (197, 64, 12, 12),
    "vit_large_patch16_224": (197, 64, 24, 16),
    "deit_tiny_patch16_224": (197, 64, 12, 3),
    "deit_small_patch16_224": (197, 64, 12, 6),
    "deit_base_patch16_224": (197, 64, 12, 12),
    "deit_tiny_distilled_patch16_224": (198, 64, 12, 3),
    "deit_small_distilled_patch16_224": (198, 64, 12, 6),
    "deit_base_distilled_patch16_224": (198, 64, 12, 12),
}


def measure(args) -> dict:
    rows = []
    total_heads, total_s = 0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for model, (n, d, layers, heads) in TABLE1_MODELS.items():
            spec = {
                "variant": PAPER.name,
                "n": n,
                "d": d,
                "heads": layers * heads * args.images,
                "device": args.device,
                "method": "batched",
                "chunk": args.chunk,
                "workers": args.threads,
                "torch_threads": 1,
                "eigh_device": args.eigh_device,
                "streams": args.streams,
                "breakdown": args.breakdown,
            }
            res, _ = _methods.measure(spec, Path(tmp))
            total_heads += res["heads"]
            total_s += res["seconds"]
            row = {"model": model, **res}
            print(json.dumps(row), flush=True)
            rows.append(row)
    settings = {name: getattr(args, name) for name in ("images", "device", "eigh_device", "streams", "threads", "chunk")}
    return {"command": "table1", **settings, "total_heads": total_heads, "total_seconds": total_s, "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    _methods.add_method_args(p, variants=False)
    p.add_argument("--images", type=int, default=1)
    p.add_argument("--eigh-device", default=None, help="cpu: eigh on the CPU for CUDA inputs (the kpca_heads rule's placement on a GPU)")
    p.add_argument("--streams", action="store_true", help="one CUDA stream per worker thread")
    p.add_argument("--breakdown", action="store_true", help="time the batched run spends in eigh, the assignments and head_metrics, summed over threads")
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
