"""Every eigensolver path available here against the solver intervals of Tables 1 and 4 (docs/uncertainty.md).

For one activation file, reruns the paper variant's per-head cosines (``kpca_records`` as the
``kpca_heads`` rule runs it: one intra-op thread, 2 workers, 64 heads per chunk) with each
eigensolver path in a child process, and sets each path's per-head cosines and its MDC and
MOC beside the solver intervals of a pipeline run with solver draws (the per-head records
CSV and ``*_signs.h5`` of ``kpca_heads``). The CKAs are not computed (the stub returns NaN):
they are not part of the check.

Paths (``--paths``, default all): ``torch-1`` / ``torch-2`` (``torch.linalg.eigh`` on 1 / 2
threads; ``torch-2`` is the pipeline's default here), ``scipy-evd`` / ``scipy-evr`` /
``scipy-evx`` (``scipy.linalg.eigh`` drivers), ``numpy`` (``numpy.linalg.eigh``),
``float64`` (``torch.linalg.eigh`` of the float32 matrix in float64, eigenvectors rounded back
to float32), and MKL's code paths through the environment: ``mkl-avx2``
(``MKL_ENABLE_INSTRUCTIONS=AVX2``), ``mkl-sse42`` (``MKL_ENABLE_INSTRUCTIONS=SSE4_2``),
``cbwr-compatible`` (``MKL_CBWR=COMPATIBLE``), ``cbwr-avx2-strict`` (``MKL_CBWR=AVX2,STRICT``);
these change MKL's float32 products (the Gram matrix) as well as its ``syevd``.

    PYTHONPATH=src python tools/solver_paths.py ACTIVATIONS.h5 RECORDS.csv RECORDS_signs.h5 --table 1 --out DIR

Writes ``DIR/<path>.csv`` (per-head cosines of each path) and ``DIR/summary.md`` (path, MDC,
MOC, inside the solver interval or not, heads whose per-head direct cosine lies outside its
per-head range), and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ENV_PATHS = {
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-sse42": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "cbwr-avx2-strict": {"MKL_CBWR": "AVX2,STRICT"},
}
PATHS = ("torch-2", "torch-1", "scipy-evd", "scipy-evr", "scipy-evx", "numpy", "float64", *ENV_PATHS)
COLUMNS = ("direct_cos_mean", "direct_cos_max", "optimal_cos_mean", "optimal_cos_max")


def _install_solver(path: str) -> int:
    """Replace ``torch.linalg.eigh`` in this process by the path's solver; returns the eigh thread count."""
    import scipy.linalg
    import torch

    torch_eigh = torch.linalg.eigh

    def wrap(fn):
        def eigh(a, *args, **kwargs):
            w, v = fn(a.detach().cpu().numpy())
            return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))

        return eigh

    if path.startswith("scipy-"):
        torch.linalg.eigh = wrap(lambda a: scipy.linalg.eigh(a, driver=path.split("-", 1)[1]))
    elif path == "numpy":
        torch.linalg.eigh = wrap(np.linalg.eigh)
    elif path == "float64":

        def eigh64(a, *args, **kwargs):
            w, v = torch_eigh(a.double())
            return w.to(a.dtype), v.to(a.dtype)

        torch.linalg.eigh = eigh64
    return 1 if path == "torch-1" else 2


def worker(path: str, activations: str, out: str, layers: list[int] | None = None) -> None:
    """Per-head cosines of one path (child process)."""
    import torch

    from kpca_repro.method import kpca

    torch.set_num_threads(1)
    threads = _install_solver(path)
    # the CKAs are not part of the check: skip their N x N kernels
    kpca._cka_kernel_sides = lambda x, paper: {"linear": x.shape[0], "rbf": x.shape[0]}
    kpca.cka_from_sides = lambda sx, sy, paper, sqrt=False: torch.full((sx,), float("nan"), dtype=torch.float64)
    from kpca_repro.method.placement import plan
    from kpca_repro.method.records import KpcaJob, kpca_records
    from kpca_repro.method.variant import PAPER

    t0 = time.time()
    records, _, _ = kpca_records(activations, KpcaJob(PAPER, placement=plan(PAPER, device=torch.device("cpu"), cores=2, eigh_threads=threads), heads_per_chunk=64, seed=0, layers=layers))
    keep = ["sample_rank", "dataset_index", "layer", "head", "dropped", *COLUMNS]
    records[keep].to_csv(out, index=False)
    print(json.dumps({"path": path, "seconds": time.time() - t0}))


def summarise(table: int, records_csv: str, signs: str, out_dir: Path, paths: list[str]) -> str:
    """Markdown summary of every path's MDC, MOC and per-head direct cosines against the solver intervals."""
    from kpca_repro.analysis import tables
    from kpca_repro.analysis.intervals import UNCERTAINTY_DEFAULTS
    from kpca_repro.method import uncertainty

    heads = pd.read_csv(records_csv)
    draws = uncertainty.read_sign_draws([signs])
    meta = {heads["model"].iloc[0]: {"n_images": 0, "n_sentences": 0, "weights_sha256": ""}}
    settings = dict(UNCERTAINTY_DEFAULTS)  # the config defaults (sign_coverage 0.99)
    row = tables.paper_table(tables.TABLES[f"table{table}"], heads, meta, draws, settings).iloc[0]
    stats = (("MDC", "direct_cos_mean", "max"), ("MOC", "optimal_cos_mean", "max")) if table == 1 else (("MDC", "direct_cos_max", "nanmean"), ("MOC", "optimal_cos_max", "nanmean"))
    per_head = "direct_cos_mean" if table == 1 else "direct_cos_max"
    if table == 1:
        # exact per-head range over every sign and every rotation inside groups within the selection
        lo, hi = draws["direct_cos_mean_range_lower"][:, 0], draws["direct_cos_mean_range_upper"][:, 0]
        own_lo, own_hi = draws["direct_cos_mean_own_lower"][:, 0], draws["direct_cos_mean_own_upper"][:, 0]
    else:
        lo, hi = np.nanmin(draws["direct_cos_max"], 1), np.nanmax(draws["direct_cos_max"], 1)
        own_lo = own_hi = None
    lines = [
        f"Table {table}, {heads['model'].iloc[0]}: MDC solver interval {row['MDC_solver_lower']:.4f}–{row['MDC_solver_upper']:.4f} "
        f"(combined {row['MDC_lower']:.4f}–{row['MDC_upper']:.4f}), MOC solver interval {row['MOC_solver_lower']:.4f}–{row['MOC_solver_upper']:.4f} "
        f"(combined {row['MOC_lower']:.4f}–{row['MOC_upper']:.4f}); pipeline MDC {row['MDC']:.4f}, MOC {row['MOC']:.4f}",
        "",
        "| path | MDC | inside | MOC | inside | heads outside their per-head range | heads outside the own-sign range (signs differ from the pipeline's) |",
        "|---|---|---|---|---|---|---|",
    ]
    # where an interval is a central range of draws (every head a random sign-and-rotation draw):
    # the rank of each path among 4000 such replicates, which is uniform if solvers behave like draws
    # (for a mean over heads: like another draw about the draws' mean)
    codes, n_groups = uncertainty.group_codes(heads["sample_rank"].to_numpy())
    rng = np.random.default_rng(0)
    draw_stats = {}
    for name, col, how in stats:
        if table == 4 or name == "MOC":
            rows = np.flatnonzero(~heads["dropped"].astype(bool).to_numpy()) if table == 1 else np.arange(len(heads))
            sub = codes[rows]
            # a mean over heads: the predictive draws of the table's own interval (uncertainty.predictive_draws)
            pick = uncertainty.pick_draws if how == "max" else uncertainty.predictive_draws
            draw_stats[name] = uncertainty.replicate_statistics(pick(draws[col][rows], rng, 4000), *uncertainty.group_codes(sub), how, None)
    lines[2] = lines[2].replace(" | heads outside", " | rank among draws (" + ", ".join(draw_stats) + ") | heads outside", 1)
    lines[3] = lines[3] + "---|"
    tol = 1e-6  # float32 round-off of the per-head values against the float32-stored bounds
    for path in paths:
        f = out_dir / f"{path}.csv"
        if not f.exists():
            lines.append(f"| {path} | – | not run | – | – | – | – | – |")
            continue
        p = pd.read_csv(f)
        assert (p[["layer", "sample_rank", "head"]].to_numpy() == heads[["layer", "sample_rank", "head"]].to_numpy()).all(), "rows differ from the records"
        kept = ~p["dropped"].astype(bool).to_numpy() if table == 1 else np.ones(len(p), bool)
        cells = []
        for name, col, how in stats:
            x = p[col].to_numpy(np.float64)[kept]
            value = np.nanmax(x) if how == "max" else np.nanmean(x)
            inside = row[f"{name}_solver_lower"] - tol <= value <= row[f"{name}_solver_upper"] + tol
            cells += [f"{value:.4f}", "yes" if inside else "**no**"]
        v = p[per_head].to_numpy(np.float64)
        finite = np.isfinite(v) & kept
        outside = int((finite & ((v < lo - tol) | (v > hi + tol))).sum())
        own = "–" if own_lo is None else str(int((finite & ((v < own_lo - tol) | (v > own_hi + tol))).sum()))
        ranks = []
        for name, col, how in stats:
            if name in draw_stats:
                x = p[col].to_numpy(np.float64)[kept]
                value = np.nanmax(x) if how == "max" else np.nanmean(x)
                ranks.append(f"{(draw_stats[name] < value).mean():.3f}")
        lines.append(f"| {path} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {' / '.join(ranks)} | {outside} of {int(finite.sum())} | {own} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("activations")
    ap.add_argument("records", nargs="?")
    ap.add_argument("signs", nargs="?")
    ap.add_argument("--table", type=int, choices=(1, 4), default=1)
    ap.add_argument("--out", default="solver_paths")
    ap.add_argument("--paths", nargs="*", default=list(PATHS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--summary-only", action="store_true")
    ap.add_argument("--layers", type=int, nargs="*", help="only these layers (a quick look; the summary needs all)")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.activations, args.records, args.layers)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.summary_only:
        for path in args.paths:
            # one OpenBLAS thread per call (SciPy, NumPy): the 2 worker threads already use the cores
            env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **ENV_PATHS.get(path, {})}
            extra = ["--layers", *map(str, args.layers)] if args.layers else []
            proc = subprocess.run([sys.executable, __file__, args.activations, str(out / f"{path}.csv"), "--worker", path, *extra], env=env, capture_output=True, text=True)
            print(path, proc.stdout.strip() or proc.stderr[-2000:], flush=True)
    text = summarise(args.table, args.records, args.signs, out, args.paths)
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
