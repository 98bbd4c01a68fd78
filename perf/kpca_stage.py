"""Where the ``kpca_heads`` job's time goes: the paper variant's KPCA stage on one activation file, as the rule runs it.

Runs :func:`kpca_repro.method.records.kpca_records` with the rule's placement
(:func:`kpca_repro.method.placement.plan`: ``--cores`` cores, ``eigh`` on the authors' thread
count) and solver draws, and times, summed over threads: the solve on the main thread (Gram
matrices, ``eigh``, V_KPCA; the workers pause meanwhile), the comparisons of V with V_KPCA
(``head_metrics`` on the workers, the head's own assignment included), and the solver draws
(``head_solver_draws``), with inside them the assignments (own and drawn, counted) and the
two bounds of the matched-cosine draws. Prints a table and writes JSON.

    python perf/kpca_stage.py results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --cores 2 --out stage.json
    python perf/kpca_stage.py ... --no-prune          # every matched-cosine draw computed (issue 34's cost)
    python perf/kpca_stage.py ... --sign-draws 0 0    # no draws at all
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time

import _bench

from kpca_repro.method.variant import PAPER, VARIANTS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("activations")
    ap.add_argument("--variant", default=PAPER.name, choices=VARIANTS)
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--eigh-threads", default="auto")
    ap.add_argument("--sign-draws", type=int, nargs=2, default=(256, 8), metavar=("DIRECT", "MATCHED"))
    ap.add_argument("--no-prune", action="store_true", help="compute every matched-cosine draw")
    ap.add_argument("--heads-per-chunk", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # as the workflow sets it (before torch loads libgomp)

    import torch

    from kpca_repro.method import kpca, numerics, records, solver_variation
    from kpca_repro.method.placement import plan

    lock = threading.Lock()
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(name, fn):
        def record(dt):
            with lock:
                seconds[name] = seconds.get(name, 0.0) + dt
                calls[name] = calls.get(name, 0) + 1

        return _bench.timed(fn, record)

    records.solve_heads = timed("solve (main thread, exclusive)", kpca.solve_heads)
    records.head_metrics = timed("compare (workers)", kpca.head_metrics)
    records.head_solver_draws = timed("solver draws (workers)", solver_variation.head_solver_draws)
    solver_variation.assignment_upper_bound = timed("  bounds of matched draws", solver_variation.assignment_upper_bound)
    solver_variation.assignment_collision_bound = timed("  collision bounds of matched draws", solver_variation.assignment_collision_bound)
    numerics.linear_sum_assignment = timed("  assignments (all)", numerics.linear_sum_assignment)
    torch.set_num_threads(1)
    place = plan(args.variant, device="cpu", cores=args.cores, eigh_threads=args.eigh_threads if args.eigh_threads == "auto" else int(args.eigh_threads))
    draws = tuple(args.sign_draws) if any(args.sign_draws) else None
    t0, c0 = time.perf_counter(), time.process_time()
    rec, meta = records.kpca_records(args.activations, args.variant, placement=place, sign_draws=draws, heads_per_chunk=args.heads_per_chunk, progress=False, prune_matched_draws=not args.no_prune)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {
        "activations": args.activations,
        "placement": place.describe(),
        "heads": len(rec),
        "sign_draws": list(args.sign_draws),
        "pruned": not args.no_prune,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "seconds": seconds,
        "calls": calls,
        "matched_draws_kept": meta.get("matched_draws_computed"),
        "matched_draws_floor": meta.get("matched_draws_floor"),
        "torch": torch.__version__,
    }
    print(f"{len(rec)} heads, {place.describe()}: {wall:.1f} s wall, {cpu:.1f} CPU-s")
    for name, sec in seconds.items():
        print(f"  {name:36s} {sec:7.1f} s  ({calls[name]} calls)")
    if out["matched_draws_kept"] is not None:
        print(f"  matched-cosine draws kept: {out['matched_draws_kept']} (floor {out['matched_draws_floor']:.6f})")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
