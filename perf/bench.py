"""The KPCA engine's benchmarks, one subcommand each; every one prints its Markdown table and,
with ``--out``, writes its result as JSON (perf/_bench.py: the result file).

    python perf/bench.py stage ACTIVATIONS.h5 [--device cpu|cuda] [--threads 2] [--chunk 16] [--variants paper corrected]
                         [--eigh-device cpu] [--eigh-threads auto|N] [--baseline-threads N] [--skip-baseline] [--breakdown]
    python perf/bench.py shapes [--device cpu|cuda] [--threads 2] [--chunk 16] [--baseline-heads 48] [--max-heads 384]
    python perf/bench.py eigensolvers [--heads 1024] [--tokens 197] [--activations A.h5] [--cpu-threads N]
    python perf/bench.py job ACTIVATIONS.h5 [--cores 2] [--sign-draws 256 8] [--no-prune]
    python perf/bench.py ab ACTIVATIONS.h5 --tree OTHER_CHECKOUT [--variant paper] [--layers 0 3 6 9 11]
    python perf/bench.py report RESULT.json ...

``stage``
    Every head of a real activation file (read as the stage reads it, one chunk per layer), for
    each variant: the batched method with ``--threads`` worker threads, then the per-head
    baseline with 1 and ``--threads`` torch threads (or ``--baseline-threads``): seconds,
    heads/s, peak RSS, the batched method's speed-up and whether both give the same numbers
    (perf/_bench.py describes the methods); for the paper variant also the Table 1 row each
    method's heads give. ``--breakdown``: where the worker threads spend their time (``eigh``,
    assignments, ``head_metrics``).
``shapes``
    The same comparison on random heads of Table 1's shapes (:data:`SHAPES`).
``eigensolvers``
    ``--heads`` centered Gram matrices ``N x N`` (``--tokens``; keys ``N(0, 0.5^2)`` of head
    dimension 64, centered as the paper variant centers them, float32; or the keys of
    ``--activations``) through every solver that runs here: ``torch-cpu-per-matrix`` (LAPACK,
    ``--cpu-threads``), ``torch-cuda-per-matrix`` (the authors' call), ``torch-cuda-batched``
    (one call for the block), ``jax-batched``, ``cupy-batched``. Reports heads/s, the largest
    eigenvalue error against float64 (relative to ``||K||``), whether the top-64 eigenvectors are
    bit-identical to the per-matrix CUDA call's, and the share of those columns with that call's
    sign. A solver that cannot run here is listed with its error.
``job``
    Where the ``kpca_heads`` job's time goes: ``kpca_records`` with the rule's placement and
    solver draws, timed by part (the solve on the main thread, the comparisons and the solver
    draws on the workers, the assignments and the bounds of the matched-cosine draws).
``ab``
    ``head_metrics`` of this tree against another checkout's on the same real heads, chunk by
    chunk in turn in one process, so that the drift of a shared machine's CPU (tens of percent
    between runs a minute apart) falls on both alike: milliseconds per head of each tree
    (``total``, ``eigh``, ``assignment``, ``everything_else``) and the largest difference of
    every per-head column.
``report``
    The tables of stored result files.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import _bench

from kpca_repro.method.variant import PAPER, VARIANTS
from kpca_repro.method.variant import get as get_variant

# --------------------------------------------------------------------------------------
# stage and shapes: the batched method against the per-head baseline
# --------------------------------------------------------------------------------------


def table1_row(out: dict, dropped) -> dict:
    """Table 1's four numbers (MDC, MOC, LCKA, KCKA) from one method's per-head outputs, by the
    pipeline's own aggregation (:func:`kpca_repro.analysis.tables.paper_table`) over the heads not ``dropped``."""
    import pandas as pd

    from kpca_repro.analysis.tables import TABLES, paper_table

    heads = pd.DataFrame({c: out[c] for c in _bench.PAPER_COLUMNS}).assign(model="m", dropped=dropped, exp_overflow=False, outer_overflow=False, allclose=False)
    row = paper_table(TABLES["table1"], heads, {"m": {"n_images": 0, "weights_sha256": ""}}).iloc[0]
    return {c: float(row[c]) for c in ("MDC", "MOC", "LCKA", "KCKA")}


def stage(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            common = {"variant": variant, "device": args.device, "activations": str(args.activations), "seed": 0}
            batched = dict(common, method="batched", chunk=args.chunk, workers=args.threads, torch_threads=1, eigh_device=args.eigh_device, breakdown=args.breakdown, eigh_threads=args.eigh_threads)
            fast_res, fast_out = _bench.measure(batched, Path(tmp))
            row = {"variant": variant, "batched": fast_res}
            outs = {"batched": fast_out}
            baselines = sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads})
            for threads in [] if args.skip_baseline else baselines:
                base_res, base_out = _bench.measure(dict(common, method="per_head", torch_threads=threads), Path(tmp))
                row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": base_res["seconds"] / fast_res["seconds"], **_bench.compare(base_out, fast_out)}
                outs[f"per_head_{threads}thr"] = base_out
            if get_variant(variant).tables == "paper":  # the Table 1 numbers each gives, over the heads the batched code keeps
                for name, out in outs.items():
                    row[f"table1_{name}"] = table1_row(out, fast_out["dropped"].astype(bool))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"command": "stage", "activations": str(args.activations), "rows": rows}


#: (tokens N, head dimension d, heads): Table 1's vision shapes (197 tokens, 198 with the
#: distillation token; 384 heads = ViT-Large's 24 layers x 16 heads of one image) and the
#: language models' 128-token windows with d = 32 (MiniLM) and d = 64.
SHAPES = ((197, 64, 384), (198, 64, 384), (128, 32, 384), (128, 64, 384))


def shapes(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, d, heads in SHAPES:
            heads = min(heads, args.max_heads)
            for variant in args.variants:
                common = {"variant": variant, "n": n, "d": d, "device": args.device, "draw": heads}
                fast_spec = dict(common, method="batched", heads=heads, chunk=args.chunk, workers=args.threads, torch_threads=1 if args.device == "cpu" else args.threads)
                fast_res, fast_out = _bench.measure(fast_spec, Path(tmp))
                fast_head = {c: a[: args.baseline_heads] for c, a in fast_out.items()}  # the baseline's heads
                row = {"N": n, "d": d, "variant": variant, "device": args.device, "batched": fast_res}
                for threads in sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads}):
                    base_res, base_out = _bench.measure(dict(common, method="per_head", heads=args.baseline_heads, torch_threads=threads), Path(tmp))
                    row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": fast_res["heads_per_second"] / base_res["heads_per_second"], **_bench.compare(base_out, fast_head)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"command": "shapes", "rows": rows}


# --------------------------------------------------------------------------------------
# eigensolvers
# --------------------------------------------------------------------------------------


def gram_matrices(heads: int, tokens: int, seed: int, activations: str | None):
    """``(heads, N, N)`` float32 centered Gram matrices (paper variant), a torch tensor."""
    import torch

    from kpca_repro.method import equations as method

    if activations:
        from kpca_repro.activations import ActivationFile

        with ActivationFile(activations) as af:
            ks = []
            for layer in range(af.n_layers):
                k = af.read(layer, ("k",))["k"]
                ks.append(torch.from_numpy(k.reshape(-1, *k.shape[2:])))
                if sum(len(x) for x in ks) >= heads:
                    break
        k = torch.cat(ks)[:heads]
    else:
        k = torch.randn(heads, tokens, 64, generator=torch.Generator().manual_seed(seed)) * 0.5
    return method.center_dense(method.gram_paper(k)[0])


def _time(fn, repeats: int = 1) -> tuple[float, object]:
    out = fn()  # warm-up (and the result)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats, out


def solvers(kc, cpu_threads: int) -> dict:
    """name -> (callable returning ``(eigenvalues, eigenvectors)`` as CPU tensors, kind); for a
    solver that cannot run here, (the exception, None)."""
    import numpy as np
    import torch

    out = {}

    def torch_cpu():
        before = torch.get_num_threads()
        torch.set_num_threads(cpu_threads)
        try:
            pairs = [torch.linalg.eigh(kc[i]) for i in range(kc.shape[0])]
        finally:
            torch.set_num_threads(before)
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    out["torch-cpu-per-matrix"] = (torch_cpu, "cpu")
    if torch.cuda.is_available():
        g = kc.cuda()

        def per_matrix():
            pairs = [torch.linalg.eigh(g[i]) for i in range(g.shape[0])]
            torch.cuda.synchronize()
            return torch.stack([p[0] for p in pairs]).cpu(), torch.stack([p[1] for p in pairs]).cpu()

        def batched():
            w, v = torch.linalg.eigh(g)
            torch.cuda.synchronize()
            return w.cpu(), v.cpu()

        out["torch-cuda-per-matrix"] = (per_matrix, "cuda")
        out["torch-cuda-batched"] = (batched, "cuda")
    try:
        import jax
        import jax.numpy as jnp

        x = jax.device_put(np.asarray(kc.numpy()))

        def jax_batched():
            w, v = jnp.linalg.eigh(x)
            w.block_until_ready()
            return torch.from_numpy(np.array(w)), torch.from_numpy(np.array(v))  # copies: writable

        out[f"jax-batched ({jax.devices()[0].platform})"] = (jax_batched, "jax")
    except Exception as exc:  # noqa: BLE001 - any import or device error: reported, not fatal
        out["jax-batched"] = (exc, None)
    try:
        import cupy

        c = cupy.asarray(kc.numpy())

        def cupy_batched():
            w, v = cupy.linalg.eigh(c)
            cupy.cuda.Device().synchronize()
            return torch.from_numpy(cupy.asnumpy(w)), torch.from_numpy(cupy.asnumpy(v))

        out["cupy-batched"] = (cupy_batched, "cupy")
    except Exception as exc:  # noqa: BLE001
        out["cupy-batched"] = (exc, None)
    return out


def eigensolvers(args) -> dict:
    import torch

    kc = gram_matrices(args.heads, args.tokens, args.seed, args.activations)
    exact = torch.linalg.eigvalsh(kc.double())
    scale = exact.abs().amax(-1, keepdim=True)
    reference = None
    rows = []
    for name, (fn, kind) in solvers(kc, args.cpu_threads).items():
        if kind is None:
            rows.append({"solver": name, "error": f"{type(fn).__name__}: {fn}"[:200]})
            continue
        try:
            seconds, (w, v) = _time(fn, args.repeats)
        except Exception as exc:  # noqa: BLE001
            rows.append({"solver": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        w, v = w.double(), v.double()
        row = {"solver": name, "heads": kc.shape[0], "seconds": seconds, "heads_per_s": kc.shape[0] / seconds, "eigenvalue_error": float(((w - exact) / scale).abs().max())}
        if name == "torch-cuda-per-matrix":
            reference = v
        rows.append((row, v))
    out_rows = []
    for item in rows:
        if isinstance(item, dict):
            out_rows.append(item)
            continue
        row, v = item
        if reference is not None:
            top_ref, top = reference[..., -64:], v[..., -64:]
            row["bit_identical_to_cuda_per_matrix"] = bool(torch.equal(top, top_ref))
            row["same_sign_share"] = float(((top * top_ref).sum(-2) > 0).double().mean())
        out_rows.append(row)
    return {
        "command": "eigensolvers",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "tokens": args.tokens,
        "rows": out_rows,
    }


def eigensolvers_table(r):
    print(f"{'solver':32s} {'heads/s':>10s} {'eig. error':>10s} {'bitwise':>8s} {'same sign':>9s}")
    for row in r["rows"]:
        if "error" in row:
            print(f"{row['solver']:32s} not run: {row['error']}")
            continue
        print(
            f"{row['solver']:32s} {row['heads_per_s']:10.0f} {row['eigenvalue_error']:10.1e} {str(row.get('bit_identical_to_cuda_per_matrix', '-')):>8s} {row.get('same_sign_share', float('nan')):9.2f}"
        )


# --------------------------------------------------------------------------------------
# job: where the kpca_heads job's time goes
# --------------------------------------------------------------------------------------


def job(args) -> dict:
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
    job = records.KpcaJob(args.variant, place, heads_per_chunk=args.heads_per_chunk, sign_draws=args.sign_draws, prune_matched_draws=not args.no_prune)
    t0, c0 = time.perf_counter(), time.process_time()
    rec, meta, _ = records.kpca_records(args.activations, job)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "command": "job",
        "activations": str(args.activations),
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
    }


def job_table(r):
    print(f"{r['heads']} heads, {r['placement']}: {r['wall_seconds']:.1f} s wall, {r['cpu_seconds']:.1f} CPU-s")
    for name, sec in r["seconds"].items():
        print(f"  {name:36s} {sec:7.1f} s  ({r['calls'][name]} calls)")
    if r["matched_draws_kept"] is not None:
        print(f"  matched-cosine draws kept: {r['matched_draws_kept']} (floor {r['matched_draws_floor']:.6f})")


# --------------------------------------------------------------------------------------
# ab: this tree against another checkout
# --------------------------------------------------------------------------------------


def import_other(tree: Path, tmp: Path):
    """The ``kpca`` module of ``tree``'s ``src/kpca_repro``, copied to ``tmp`` and imported as package ``kpca_other``."""
    shutil.copytree(tree / "src" / "kpca_repro", tmp / "kpca_other")
    for source in (tmp / "kpca_other").rglob("*.py"):  # absolute imports of the copy stay inside the copy
        source.write_text(re.sub(r"\bkpca_repro\b", "kpca_other", source.read_text()))
    spec = importlib.util.spec_from_file_location("kpca_other", tmp / "kpca_other" / "__init__.py", submodule_search_locations=[str(tmp / "kpca_other")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["kpca_other"] = pkg
    spec.loader.exec_module(pkg)
    # the copied tree's engine: kpca_other.method.kpca (package by stage) or kpca_other.kpca (older, flat trees)
    return importlib.import_module("kpca_other.method.kpca" if (tmp / "kpca_other" / "method" / "kpca.py").is_file() else "kpca_other.kpca")


def read_heads(args):
    """``(k, v, base)``: the first ``--heads-per-layer`` heads of each of ``--layers``, as the KPCA stage reads them
    (float32 ``(heads, N, d)``; ``base`` the variant's float64 baseline noise, seed 0, or None)."""
    import torch

    from kpca_repro.activations import ActivationFile
    from kpca_repro.method.records import baseline_noise, layer_chunks

    ks, vs, bs = [], [], []
    with ActivationFile(args.activations) as af:
        per_layer = len(af.sample_rank) * int(af.attrs["n_heads"])
        for layer, _, t in layer_chunks(af, args.layers, per_layer):
            ks.append(t["k"][: args.heads_per_layer])
            vs.append(t["v"][: args.heads_per_layer])
            if get_variant(args.variant).baselines:
                shape = (int(af.attrs["n_heads"]), *t["v"].shape[1:])
                bs.append(torch.cat([baseline_noise(0, di, layer, shape) for di in af.dataset_index])[: args.heads_per_layer])
    return torch.cat(ks), torch.cat(vs), (torch.cat(bs) if bs else None)


class TreeTimers:
    """Seconds each tree spends in ``head_metrics`` (``total``), ``eigh`` and the assignments.

    :meth:`install` wraps ``torch.linalg.eigh`` (shared by both trees) and each tree's
    ``linear_sum_assignment``; the time goes to the tree that :meth:`run` is running.
    """

    def __init__(self):
        self.current = "this"
        self.reset()

    def reset(self):
        self.seconds = {name: {"total": 0.0, "eigh": 0.0, "assignment": 0.0} for name in ("this", "other")}

    def timed(self, kind, fn):
        def record(dt):
            self.seconds[self.current][kind] += dt

        return _bench.timed(fn, record)

    def install(self, modules):
        import torch

        self.real_eigh = torch.linalg.eigh
        torch.linalg.eigh = self.timed("eigh", self.real_eigh)
        for mod in modules:  # the solver lives in <package>.numerics (older trees: <package>.kpca)
            numerics = sys.modules.get(mod.__name__.rsplit(".", 1)[0] + ".numerics")
            holder = numerics if getattr(numerics, "linear_sum_assignment", None) else mod
            holder.linear_sum_assignment = self.timed("assignment", holder.linear_sum_assignment)

    def uninstall(self):
        import torch

        torch.linalg.eigh = self.real_eigh

    def run(self, name, mod, heads, variant, chunk, eigh_threads) -> dict:
        """``mod.head_metrics`` over ``heads`` (k, v, base) in chunks, timed as tree ``name``; the per-head columns."""
        import numpy as np

        k, v, base = heads
        self.current = name
        parts = []
        t0 = time.perf_counter()
        for lo in range(0, k.shape[0], chunk):
            b = None if base is None else base[lo : lo + chunk]
            parts.append(mod.head_metrics(k[lo : lo + chunk], v[lo : lo + chunk], variant, baseline=b, **_solver_kw(mod, variant, eigh_threads)))
        self.seconds[name]["total"] += time.perf_counter() - t0
        return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


def _solver_kw(mod, variant, eigh_threads) -> dict:
    """The eigh threads in the tree's own terms: a placement (since issue 45) or eigh_threads (before)."""
    if "placement" in inspect.signature(mod.head_metrics).parameters:
        place = importlib.import_module(mod.__name__.rsplit(".", 1)[0] + ".placement").Placement
        return {"placement": place.local("cpu", eigh_threads=eigh_threads, per_head_products=get_variant(variant).authors_threads)}
    return {"eigh_threads": eigh_threads}


def _ms_per_head(seconds: dict, calls: int) -> dict:
    """Each tree's seconds as milliseconds per head over ``calls`` head evaluations, and ``everything_else``."""
    per_head = {}
    for name, sec in seconds.items():
        ms = {key: 1e3 * val / calls for key, val in sec.items()}
        ms["everything_else"] = ms["total"] - ms["eigh"] - ms["assignment"]
        per_head[name] = ms
        print(json.dumps({"tree": name, "ms_per_head": {key: round(val, 3) for key, val in ms.items()}}), flush=True)
    return per_head


def ab(args) -> dict:
    import numpy as np
    import torch

    from kpca_repro.method import kpca as this

    tmp = Path(tempfile.mkdtemp())
    other = import_other(Path(args.tree).resolve(), tmp)
    torch.set_num_threads(1)
    heads = read_heads(args)
    n = heads[0].shape[0]
    eigh_threads = None
    if get_variant(args.variant).authors_threads:
        from kpca_repro.threads import torch_default_threads

        eigh_threads = torch_default_threads()
    timers = TreeTimers()
    timers.install((this, other))
    run = lambda name, mod: timers.run(name, mod, heads, args.variant, args.chunk, eigh_threads)  # noqa: E731
    run("other", other)  # warm-up, not counted
    run("this", this)
    timers.reset()
    for _ in range(args.repeats):
        out_other, out_this = run("other", other), run("this", this)
    timers.uninstall()
    shutil.rmtree(tmp)
    per_head = _ms_per_head(timers.seconds, args.repeats * n)
    diffs = {c: float(np.nanmax(np.abs(out_this[c].astype(float) - out_other[c].astype(float)), initial=0.0)) for c in out_this if out_this[c].dtype != bool}
    settings = {"tree": str(Path(args.tree).resolve()), "variant": args.variant, "heads": n, "chunk": args.chunk, "repeats": args.repeats}
    return {"command": "ab", **settings, "eigh_threads": eigh_threads, "ms_per_head": per_head, "max_abs_diff": diffs}


# --------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------


def _f(x, nd=1):
    return "–" if x is None else f"{x:.{nd}f}"


def _breakdown(items):
    """``--breakdown``: where the worker threads spent their time (seconds summed over threads)."""
    items = [(label, res) for label, res in items if "breakdown" in res]
    if not items:
        return
    print("| run | wall s | thread-seconds available | in head_metrics | in eigh | in assignments | other in head_metrics | waiting | ms per head: eigh / assignments / other |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, res in items:
        b = res["breakdown"]
        other = b["head_metrics_seconds"] - b["eigh_seconds"] - b["assignment_seconds"]
        wait = b["thread_seconds_available"] - b["head_metrics_seconds"]
        per_head = " / ".join(f"{1000 * t / res['heads']:.2f}" for t in (b["eigh_seconds"], b["assignment_seconds"], other))
        print(
            f"| {label} | {res['seconds']:.1f} | {b['thread_seconds_available']:.1f} | {b['head_metrics_seconds']:.1f} | "
            f"{b['eigh_seconds']:.1f} | {b['assignment_seconds']:.1f} | {other:.1f} | {wait:.1f} | {per_head} |"
        )
    print()


def stage_table(r):
    print(f"loadavg 1 min at start / end: {r['environment']['loadavg_1min_at_start']} / {r['environment']['loadavg_1min_at_end']}\n")
    print("| variant | method | heads | seconds | heads/s | peak RSS MB | batched speed-up | max abs diff vs batched | same dropped heads (paper) or bit-identical (corrected) |")
    print("|---|---|---|---|---|---|---|---|---|")
    argv = r.get("argv", [])
    workers = argv[argv.index("--threads") + 1] if "--threads" in argv else "2"
    for row in r["rows"]:
        b = row["batched"]
        print(f"| {row['variant']} | batched, {workers} worker thread(s) x 1 torch thread | {b['heads']} | {_f(b['seconds'])} | {_f(b['heads_per_second'])} | {_f(b['peak_rss_mb'], 0)} | – | – | – |")
        for key, p in row.items():
            if key.startswith("per_head_"):
                same = p.get("bit_identical", p.get("same_dropped_heads"))
                print(
                    f"| {row['variant']} | per-head baseline, {key[9:].replace('thr', ' torch thread(s)')} | {p['heads']} | {_f(p['seconds'])} | {_f(p['heads_per_second'])} | {_f(p['peak_rss_mb'], 0)} | {p['speedup_of_batched']:.2f}x | {p['max_abs_diff']:.1e} | {same} |"
                )
        for key, t in row.items():
            if key.startswith("table1_"):
                print(f"\n{key}: " + ", ".join(f"{k} {v:.6f}" for k, v in t.items()))
    print()
    _breakdown([(f"batched, {row['variant']}", row["batched"]) for row in r["rows"]])


def shapes_table(r):
    print(f"loadavg 1 min at start / end: {r['environment']['loadavg_1min_at_start']} / {r['environment']['loadavg_1min_at_end']}\n")
    print("| N | d | variant | batched heads/s (heads) | peak RSS MB | per-head 1 thr heads/s | speed-up | per-head 2 thr heads/s | speed-up | max abs diff (1 thr) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        b, p1, p2 = row["batched"], row.get("per_head_1thr", {}), row.get("per_head_2thr", {})
        print(
            f"| {row['N']} | {row['d']} | {row['variant']} | {_f(b['heads_per_second'])} ({b['heads']}) | {_f(b['peak_rss_mb'], 0)} | "
            f"{_f(p1.get('heads_per_second'))} | {_f(p1.get('speedup_of_batched'), 2)}x | {_f(p2.get('heads_per_second'))} | {_f(p2.get('speedup_of_batched'), 2)}x | {p1.get('max_abs_diff', float('nan')):.1e} |"
        )
    print()


def ab_table(r):
    print(f"{r['variant']} variant, {r['heads']} heads x {r['repeats']} repeats, chunks of {r['chunk']}, eigh threads {r['eigh_threads']}, other tree {r['tree']}\n")
    print("| tree | head_metrics ms/head | eigh | assignments | everything else |\n|---|---|---|---|---|")
    for name, ms in r["ms_per_head"].items():
        print(f"| {name} | {ms['total']:.2f} | {ms['eigh']:.2f} | {ms['assignment']:.2f} | {ms['everything_else']:.2f} |")
    diff = max(r["max_abs_diff"].values(), default=0.0)
    print(f"\nlargest per-head difference between the trees: {diff:.1e}\n")


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    def command(name: str, measure, table, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(measure=measure, table=table)
        sp.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
        return sp

    sp = command("stage", stage, stage_table, "the batched method against the per-head baseline on a real activation file")
    _bench.add_method_args(sp)
    sp.add_argument("activations", type=Path)
    sp.add_argument("--eigh-device", default=None, help="cpu: eigh on the CPU for CUDA inputs (the kpca_heads rule's placement on a GPU)")
    sp.add_argument("--breakdown", action="store_true", help="time the batched run spends in eigh, the assignments and head_metrics, summed over threads")
    sp.add_argument("--baseline-threads", type=int, default=None, help="torch threads of the per-head baseline (default: 1 and --threads)")
    sp.add_argument("--skip-baseline", action="store_true", help="time the batched method only")
    sp.add_argument("--eigh-threads", default=None, help="'auto': the kpca_heads rule's eigh threads (torch's default for the paper variant); an int; default: the caller's (one)")

    sp = command("shapes", shapes, shapes_table, "the same comparison on random heads of Table 1's shapes")
    _bench.add_method_args(sp)
    sp.add_argument("--baseline-heads", type=int, default=48, help="heads the per-head baseline runs (it is slow)")
    sp.add_argument("--max-heads", type=int, default=384, help="cap on the batched heads per shape (smoke runs)")
    sp.add_argument("--baseline-threads", type=int, default=None, help="torch threads of the per-head baseline (default: 1 and --threads)")

    sp = command("eigensolvers", eigensolvers, eigensolvers_table, "throughput and agreement of every eigensolver that runs here")
    sp.add_argument("--heads", type=int, default=1024)
    sp.add_argument("--tokens", type=int, default=197)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--activations", help="take the keys of this activation file instead of random ones")
    sp.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    sp.add_argument("--repeats", type=int, default=1)

    sp = command("job", job, job_table, "where the kpca_heads job's time goes")
    sp.add_argument("activations", type=Path)
    sp.add_argument("--variant", default=PAPER.name, choices=VARIANTS)
    sp.add_argument("--cores", type=int, default=2)
    sp.add_argument("--eigh-threads", default="auto")
    sp.add_argument("--sign-draws", type=int, nargs=2, default=(256, 8), metavar=("DIRECT", "MATCHED"), help="0 0: no draws")
    sp.add_argument("--no-prune", action="store_true", help="compute every matched-cosine draw")
    sp.add_argument("--heads-per-chunk", type=int, default=64)

    sp = command("ab", ab, ab_table, "head_metrics of this tree against another checkout, interleaved")
    sp.add_argument("activations", type=Path)
    sp.add_argument("--tree", required=True, help="the other checkout (its src/kpca_repro is imported as kpca_other)")
    sp.add_argument("--variant", default=PAPER.name, choices=VARIANTS)
    sp.add_argument("--layers", type=int, nargs="+", default=[0, 3, 6, 9, 11])
    sp.add_argument("--heads-per-layer", type=int, default=120, help="the first heads of each layer")
    sp.add_argument("--chunk", type=int, default=64, help="heads per head_metrics call (the rule's default kpca.heads_per_chunk)")
    sp.add_argument("--repeats", type=int, default=3)

    sp = sub.add_parser("report", help="the tables of stored result files")
    sp.add_argument("results", type=Path, nargs="+")

    args = p.parse_args(argv)
    if args.command == "report":
        for path in args.results:
            r = json.loads(path.read_text())
            print(f"### {path.name}\n")
            TABLES[r["command"]](r)
        return None
    result = _bench.finish(args, args.measure, argv)
    args.table(result)
    return result


#: The table of each subcommand's result, for ``report``.
TABLES = {"stage": stage_table, "shapes": shapes_table, "eigensolvers": eigensolvers_table, "job": job_table, "ab": ab_table}


if __name__ == "__main__":
    main()
