"""Heads per second of the batched KPCA method against the per-head baseline, on random heads of Table 1's shapes.

    python perf/bench_shapes.py [--device cpu|cuda] [--threads 2] [--chunk 16] [--variants paper corrected]
                                [--baseline-heads 48] [--max-heads 384] [--baseline-threads N] [--out shapes.json]

For each shape of :data:`SHAPES` and each variant: the batched method on up to ``--max-heads``
random heads, and the per-head baseline on the first ``--baseline-heads`` of them, with 1 and
``--threads`` torch threads (or ``--baseline-threads``): heads/s, peak RSS, the batched method's
speed-up and whether both give the same numbers (perf/_methods.py describes the methods).
Writes ``{"command": "shapes", "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import _bench
import _methods

#: (tokens N, head dimension d, heads): Table 1's vision shapes (197 tokens, 198 with the
#: distillation token; 384 heads = ViT-Large's 24 layers x 16 heads of one image) and the
#: language models' 128-token windows with d = 32 (MiniLM) and d = 64.
SHAPES = ((197, 64, 384), (198, 64, 384), (128, 32, 384), (128, 64, 384))


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, d, heads in SHAPES:
            heads = min(heads, args.max_heads)
            for variant in args.variants:
                common = {"variant": variant, "n": n, "d": d, "device": args.device, "draw": heads}
                fast_spec = dict(common, method="batched", heads=heads, chunk=args.chunk, workers=args.threads, torch_threads=1 if args.device == "cpu" else args.threads)
                fast_res, fast_out = _methods.measure(fast_spec, Path(tmp))
                fast_head = {c: a[: args.baseline_heads] for c, a in fast_out.items()}  # the baseline's heads
                row = {"N": n, "d": d, "variant": variant, "device": args.device, "batched": fast_res}
                for threads in sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads}):
                    base_res, base_out = _methods.measure(dict(common, method="per_head", heads=args.baseline_heads, torch_threads=threads), Path(tmp))
                    row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": fast_res["heads_per_second"] / base_res["heads_per_second"], **_methods.compare(base_out, fast_head)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"command": "shapes", "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    _methods.add_method_args(p)
    p.add_argument("--baseline-heads", type=int, default=48, help="heads the per-head baseline runs (it is slow)")
    p.add_argument("--max-heads", type=int, default=384, help="cap on the batched heads per shape (smoke runs)")
    p.add_argument("--baseline-threads", type=int, default=None, help="torch threads of the per-head baseline (default: 1 and --threads)")
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
