"""The KPCA stage on a real activation file: the batched method against the per-head baseline.

    python perf/bench_stage.py ACTIVATIONS.h5 [--device cpu|cuda] [--threads 2] [--chunk 16] [--variants paper corrected]
                               [--eigh-device cpu] [--eigh-threads auto|N] [--baseline-threads N] [--skip-baseline]
                               [--breakdown] [--out stage.json]

Every head of the file (read as the stage reads it, one chunk per layer), for each variant: the
batched method with ``--threads`` worker threads, then the per-head baseline with 1 and
``--threads`` torch threads (or ``--baseline-threads``; none with ``--skip-baseline``): seconds,
heads/s, peak RSS, the batched method's speed-up and whether both give the same numbers
(perf/_methods.py describes the methods). For the paper variant also the Table 1 row each
method's heads give (``table1_<method>``). ``--breakdown``: where the batched run's worker
threads spend their time (``eigh``, assignments, ``head_metrics``). Writes
``{"command": "stage", "activations": ..., "rows": [...]}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import _bench
import _methods

from kpca_repro.method.variant import get as get_variant


def table1_row(out: dict, dropped) -> dict:
    """Table 1's four numbers (MDC, MOC, LCKA, KCKA) from one method's per-head outputs, by the
    pipeline's own aggregation (:func:`kpca_repro.analysis.tables.paper_table`) over the heads not ``dropped``."""
    import pandas as pd

    from kpca_repro.analysis.tables import TABLES, paper_table

    heads = pd.DataFrame({c: out[c] for c in _methods.PAPER_COLUMNS}).assign(model="m", dropped=dropped, exp_overflow=False, outer_overflow=False, allclose=False)
    row = paper_table(TABLES["table1"], heads, {"m": {"n_images": 0, "weights_sha256": ""}}).iloc[0]
    return {c: float(row[c]) for c in ("MDC", "MOC", "LCKA", "KCKA")}


def measure(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            common = {"variant": variant, "device": args.device, "activations": str(args.activations), "seed": 0}
            batched = dict(common, method="batched", chunk=args.chunk, workers=args.threads, torch_threads=1, eigh_device=args.eigh_device, breakdown=args.breakdown, eigh_threads=args.eigh_threads)
            fast_res, fast_out = _methods.measure(batched, Path(tmp))
            row = {"variant": variant, "batched": fast_res}
            outs = {"batched": fast_out}
            baselines = sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads})
            for threads in [] if args.skip_baseline else baselines:
                base_res, base_out = _methods.measure(dict(common, method="per_head", torch_threads=threads), Path(tmp))
                row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": base_res["seconds"] / fast_res["seconds"], **_methods.compare(base_out, fast_out)}
                outs[f"per_head_{threads}thr"] = base_out
            if get_variant(variant).tables == "paper":  # the Table 1 numbers each gives, over the heads the batched code keeps
                for name, out in outs.items():
                    row[f"table1_{name}"] = table1_row(out, fast_out["dropped"].astype(bool))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"command": "stage", "activations": str(args.activations), "rows": rows}


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    _methods.add_method_args(p)
    p.add_argument("activations", type=Path)
    p.add_argument("--eigh-device", default=None, help="cpu: eigh on the CPU for CUDA inputs (the kpca_heads rule's placement on a GPU)")
    p.add_argument("--breakdown", action="store_true", help="time the batched run spends in eigh, the assignments and head_metrics, summed over threads")
    p.add_argument("--baseline-threads", type=int, default=None, help="torch threads of the per-head baseline (default: 1 and --threads)")
    p.add_argument("--skip-baseline", action="store_true", help="time the batched method only")
    p.add_argument("--eigh-threads", default=None, help="'auto': the kpca_heads rule's eigh threads (torch's default for the paper variant); an int; default: the caller's (one)")
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
