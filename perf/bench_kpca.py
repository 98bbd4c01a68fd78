"""Benchmarks of the KPCA and metrics stage (not tests: nothing here asserts a time).

    python perf/bench_kpca.py shapes  [--device cpu|cuda] [--threads 2] [--out shapes.json]
    python perf/bench_kpca.py stage   ACTIVATIONS.h5 [--threads 2] [--breakdown] [--out ...]
    python perf/bench_kpca.py table1  [--images 1] [--device cuda] [--threads 14] [--breakdown] [--out ...]
    python perf/bench_kpca.py memory  --images 4 16 100 [--model vit_large_patch16_224] [--out ...]
    python perf/bench_kpca.py chain   --configfile config/offline_deit_tiny.yaml [--cores 2] [--out ...]
    python perf/bench_kpca.py authors [--model deit_tiny_patch16_224] [--images 100] [--out ...]
    python perf/bench_kpca.py extract [--tree OTHER_CHECKOUT] [--repeats 2] [--out ...]
    python perf/bench_kpca.py concurrent ACTIVATIONS.h5 [--layers 0 1] [--spincounts 3000 default] [--out ...]
    python perf/bench_kpca.py allocator ACTIVATIONS.h5 [--layers 1 12] [--threads 2] [--out ...]
    python perf/bench_kpca.py ab      ACTIVATIONS.h5 --tree OTHER_CHECKOUT [--variant paper] [--chunk 64] [--repeats 3] [--out ...]

Methods compared (each measurement runs in its own subprocess, so peak RSS is its own):

``per_head`` (paper variant)
    ``tools/kpca_tools/reference.py``: the per-head transcription of the authors' ``value_vectors.py``
    (docs/method.md Section 12): one ``eigh``, one CKA helper call per CKA, one assignment per head,
    Python loops over heads. It is the test oracle of the batched code and is imported, not
    copied, so the baseline stays independent of what it measures.
``per_head`` (corrected variant)
    :func:`kpca_repro.method.kpca.head_metrics` called on one head at a time.
``batched``
    What the ``kpca_vision`` rule runs: chunks of ``--chunk`` heads through ``head_metrics``,
    ``--threads`` chunks at a time on worker threads (:func:`kpca_repro.threads.ordered_map`),
    one intra-op torch thread on the CPU.

Every measurement also checks that the methods produce the same numbers (``max_abs_diff``:
largest difference over the per-head columns both produce).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kpca_repro.method.variant import PAPER, VARIANTS
from kpca_repro.method.variant import get as get_variant

REPO = Path(__file__).resolve().parents[1]
# the per-head baseline (kpca_tools.reference) is a test tool, never installed (tools/README.md)
sys.path.insert(0, str(REPO / "tools"))

#: (tokens N, head dimension d, heads): Table 1's vision shapes (197 tokens, 198 with the
#: distillation token; 384 heads = ViT-Large's 24 layers x 16 heads of one image) and the
#: language models' 128-token windows with d = 32 (MiniLM) and d = 64.
SHAPES = ((197, 64, 384), (198, 64, 384), (128, 32, 384), (128, 64, 384))

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

PAPER_COLUMNS = ("direct_cos_mean", "direct_cos_max", "direct_cos_min", "optimal_cos_mean", "optimal_cos_max", "linear_cka", "rbf_cka")


def _environment() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _random_heads(n_heads: int, n: int, d: int, seed: int = 0, baseline: bool = True):
    """Keys and values of ViT-like magnitude (``s k.k`` of order 1-10) and a baseline draw."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_heads, n, d, generator=gen) * 1.5 + torch.randn(n_heads, 1, d, generator=gen)
    v = torch.randn(n_heads, n, d, generator=gen)
    base = torch.randn(n_heads, n, d, generator=gen, dtype=torch.float64) if baseline else torch.zeros(n_heads, 0)
    return k, v, base


# --------------------------------------------------------------------------------------
# One measurement (runs in a subprocess)
# --------------------------------------------------------------------------------------


def _per_head_paper(k, v):
    import numpy as np

    from kpca_tools.reference import head_metrics_reference

    rows = [head_metrics_reference(k[h], v[h]) for h in range(k.shape[0])]
    return {c: np.array([np.nan if r is None else r[c] for r in rows]) for c in PAPER_COLUMNS}


def _per_head(k, v, base, variant):
    import numpy as np

    from kpca_repro.method.kpca import head_metrics

    kw = lambda h: {"baseline": base[h : h + 1]} if get_variant(variant).baselines else {}  # noqa: E731
    rows = [head_metrics(k[h : h + 1], v[h : h + 1], variant, **kw(h)) for h in range(k.shape[0])]
    return {c: np.concatenate([r[c] for r in rows]) for c in rows[0]}


def _batched(k, v, base, variant, device, chunk, workers, eigh_device=None, streams=False, eigh_threads=None):
    import dataclasses

    import numpy as np
    import torch

    from kpca_repro.method import kpca
    from kpca_repro.method.placement import plan
    from kpca_repro.threads import device_stream, ordered_map

    # the job's placement, with the solver's device as asked (eigh_device "cpu": LAPACK per matrix beside a GPU)
    place = plan(variant, device=str(device), cores=workers, eigh_threads=eigh_threads)
    if eigh_device is not None:
        solver = torch.device(eigh_device)
        place = dataclasses.replace(place, eigh_device=solver, eigh_batched=solver.type != "cpu")

    def work(lo):
        hi = min(lo + chunk, k.shape[0])
        with device_stream(device, streams):
            b = base[lo:hi].to(device) if get_variant(variant).baselines else None
            return kpca.head_metrics(k[lo:hi].to(device), v[lo:hi].to(device), variant, baseline=b, placement=place)

    parts = list(ordered_map(work, range(0, k.shape[0], chunk), workers=workers, budget=place.budget))
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


class _Timers:
    """Wall seconds spent inside ``eigh``, the assignments and ``head_metrics``, summed over threads.

    ``--breakdown`` wraps ``torch.linalg.eigh`` and :mod:`kpca_repro.method.kpca`'s
    ``linear_sum_assignment`` (and, for the batched method, ``head_metrics``) so a run tells
    where the worker threads spend their time: ``threads x wall - head_metrics`` is time a
    worker waited (for the reader, the GIL or the result queue); ``head_metrics - eigh -
    assignment`` is everything else (Gram, centering, CKA, transfers, Python).
    """

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.seconds = {"eigh": 0.0, "assignment": 0.0, "head_metrics": 0.0}
        self.calls = {name: 0 for name in self.seconds}

    def wrap(self, name, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.seconds[name] += dt
                    self.calls[name] += 1

        return timed

    def install(self):
        import torch

        from kpca_repro.method import kpca, numerics

        torch.linalg.eigh = self.wrap("eigh", torch.linalg.eigh)
        numerics.linear_sum_assignment = self.wrap("assignment", numerics.linear_sum_assignment)
        kpca.head_metrics = self.wrap("head_metrics", kpca.head_metrics)

    def reset(self):
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0


def _one(spec: dict) -> dict:
    """Run one (method, variant, shape, device) measurement; write its outputs to spec['npz']."""
    import numpy as np
    import torch

    torch.set_num_threads(spec["torch_threads"])
    device = torch.device(spec["device"])
    if spec.get("activations"):
        k, v, base = _read_file(spec["activations"], spec["variant"], spec.get("seed", 0))
    else:  # one draw of `draw` heads; the baseline takes its first `heads`
        k, v, base = _random_heads(spec.get("draw", spec["heads"]), spec["n"], spec["d"], baseline=get_variant(spec["variant"]).baselines)
    k, v, base = k[: spec.get("heads")], v[: spec.get("heads")], base[: spec.get("heads")]
    timers = _Timers() if spec.get("breakdown") else None
    if timers:
        timers.install()
    run = lambda k, v, base: _run_method(spec, device, k, v, base)  # noqa: E731
    run(k[:2], v[:2], base[:2])  # warm-up (first eigh/LAPACK workspace, scipy import), not timed
    if timers:
        timers.reset()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = run(k, v, base)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    np.savez(spec["npz"], **out)
    res = {
        "seconds": wall,
        "heads": int(k.shape[0]),
        "heads_per_second": k.shape[0] / wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if device.type == "cuda":
        res["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    if timers:
        workers = spec.get("workers", 1) if spec["method"] == "batched" else 1
        res["breakdown"] = {
            "workers": workers,
            "thread_seconds_available": workers * wall,
            **{f"{name}_seconds": sec for name, sec in timers.seconds.items()},
            **{f"{name}_calls": n for name, n in timers.calls.items()},
        }
    return res


def _run_method(spec, device, k, v, base):
    if spec["method"] == "per_head":
        if get_variant(spec["variant"]).authors_formulas and device.type == "cpu":  # the authors' per-head code
            return _per_head_paper(k, v)
        # the oracle builds its constant matrices on the CPU: on CUDA the per-head baseline is
        # head_metrics on one head at a time (same per-head structure: one eigh, CKA, assignment)
        return _per_head(k.to(device), v.to(device), base.to(device), spec["variant"])
    eigh_threads = spec.get("eigh_threads")
    if eigh_threads == "auto":  # the kpca_heads rule: torch's default count for the paper variant, the caller's for the corrected one
        from kpca_repro.threads import torch_default_threads

        eigh_threads = torch_default_threads() if get_variant(spec["variant"]).authors_threads else None
    elif eigh_threads is not None:
        eigh_threads = int(eigh_threads)
    return _batched(k, v, base, spec["variant"], device, spec["chunk"], spec["workers"], spec.get("eigh_device"), spec.get("streams", False), eigh_threads)


def _read_file(path, variant, seed):
    """Every head of an activation file as (heads, N, d) tensors, in (layer, image, head) order
    (read as the KPCA stage reads it: :func:`kpca_repro.method.records.layer_chunks`, one chunk per layer)."""
    import torch

    from kpca_repro.activations import ActivationFile
    from kpca_repro.method.records import baseline_noise, layer_chunks

    ks, vs, bs = [], [], []
    with ActivationFile(path) as af:
        per_layer = len(af.sample_rank) * int(af.attrs["n_heads"])
        for layer, _, t in layer_chunks(af, range(af.n_layers), per_layer):
            ks.append(t["k"])
            vs.append(t["v"])
            if get_variant(variant).baselines:
                shape = (int(af.attrs["n_heads"]), *t["v"].shape[1:])
                bs.append(torch.cat([baseline_noise(seed, di, layer, shape) for di in af.dataset_index]))
    k, v = torch.cat(ks), torch.cat(vs)
    return k, v, (torch.cat(bs) if bs else torch.zeros(0))


def _table1_row(out: dict, dropped) -> dict:
    """Table 1's four numbers from one method's per-head outputs, by the pipeline's own
    aggregation (:func:`kpca_repro.analysis.tables.paper_table`) over the heads not ``dropped``."""
    import pandas as pd

    from kpca_repro.analysis.tables import TABLES, paper_table

    heads = pd.DataFrame({c: out[c] for c in PAPER_COLUMNS}).assign(model="m", dropped=dropped, exp_overflow=False, outer_overflow=False, allclose=False)
    row = paper_table(TABLES["table1"], heads, {"m": {"n_images": 0, "weights_sha256": ""}}).iloc[0]
    return {c: float(row[c]) for c in ("MDC", "MOC", "LCKA", "KCKA")}


def _measure(spec: dict, tmp: Path) -> tuple[dict, dict]:
    """Run ``spec`` in a fresh interpreter; return (timing, outputs)."""
    import numpy as np

    spec = dict(spec, npz=str(tmp / f"out_{os.getpid()}_{time.monotonic_ns()}.npz"))
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, __file__, "_one", json.dumps(spec)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    with np.load(spec["npz"]) as z:
        out = {c: z[c] for c in z.files}
    return res, out


def _max_abs_diff(a: dict, b: dict, columns=None) -> float:
    import numpy as np

    cols = [c for c in (columns or a) if c in a and c in b]
    diffs = [np.nanmax(np.abs(a[c].astype(float) - b[c].astype(float)), initial=0.0) for c in cols]
    return float(max(diffs)) if diffs else float("nan")


def _compare(base_out: dict, fast_out: dict) -> dict:
    import numpy as np

    if "dropped" not in base_out:  # the authors' per-head oracle: NaN where the reference drops a head
        ok = np.isfinite(base_out["linear_cka"])
        same_dropped = bool(np.array_equal(~ok, fast_out["dropped"].astype(bool)))
        sub = lambda o: {c: o[c][ok] for c in PAPER_COLUMNS}  # noqa: E731
        return {"max_abs_diff": _max_abs_diff(sub(base_out), sub(fast_out)), "same_dropped_heads": same_dropped}
    identical = all(np.array_equal(base_out[c], fast_out[c], equal_nan=True) for c in base_out)
    return {"max_abs_diff": _max_abs_diff(base_out, fast_out), "bit_identical": identical}


# --------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------


def cmd_shapes(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, d, heads in SHAPES:
            heads = min(heads, args.max_heads)
            for variant in args.variants:
                common = {"variant": variant, "n": n, "d": d, "device": args.device, "draw": heads}
                fast_spec = dict(common, method="batched", heads=heads, chunk=args.chunk, workers=args.threads, torch_threads=1 if args.device == "cpu" else args.threads)
                fast_res, fast_out = _measure(fast_spec, Path(tmp))
                fast_head = {c: a[: args.baseline_heads] for c, a in fast_out.items()}  # the baseline's heads
                row = {"N": n, "d": d, "variant": variant, "device": args.device, "batched": fast_res}
                for threads in sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads}):
                    base_res, base_out = _measure(dict(common, method="per_head", heads=args.baseline_heads, torch_threads=threads), Path(tmp))
                    row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": fast_res["heads_per_second"] / base_res["heads_per_second"], **_compare(base_out, fast_head)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"command": "shapes", "rows": rows}


def cmd_stage(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            common = {"variant": variant, "device": args.device, "activations": str(args.activations), "seed": 0}
            batched = dict(common, method="batched", chunk=args.chunk, workers=args.threads, torch_threads=1, eigh_device=args.eigh_device, breakdown=args.breakdown, eigh_threads=args.eigh_threads)
            fast_res, fast_out = _measure(batched, Path(tmp))
            row = {"variant": variant, "batched": fast_res}
            outs = {"batched": fast_out}
            baselines = sorted({1, args.threads} if args.baseline_threads is None else {args.baseline_threads})
            for threads in [] if args.skip_baseline else baselines:
                base_res, base_out = _measure(dict(common, method="per_head", torch_threads=threads), Path(tmp))
                row[f"per_head_{threads}thr"] = {**base_res, "speedup_of_batched": base_res["seconds"] / fast_res["seconds"], **_compare(base_out, fast_out)}
                outs[f"per_head_{threads}thr"] = base_out
            if get_variant(variant).tables == "paper":  # the Table 1 numbers each gives, over the heads the batched code keeps
                for name, out in outs.items():
                    row[f"table1_{name}"] = _table1_row(out, fast_out["dropped"].astype(bool))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"command": "stage", "activations": str(args.activations), "rows": rows}


def cmd_table1(args) -> dict:
    """Table 1's whole workload (10 models x ``images``; 1,140 heads per image), random values."""
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
            res, _ = _measure(spec, Path(tmp))
            total_heads += res["heads"]
            total_s += res["seconds"]
            row = {"model": model, **res}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {
        "command": "table1",
        "images": args.images,
        "device": args.device,
        "eigh_device": args.eigh_device,
        "streams": args.streams,
        "threads": args.threads,
        "chunk": args.chunk,
        "total_heads": total_heads,
        "total_seconds": total_s,
        "rows": rows,
    }


def _rss_of(cmd: list[str], env: dict) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return wall, json.loads(proc.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def cmd_memory(args) -> dict:
    """Peak host memory of extraction and KPCA for one model and growing numbers of images."""
    rows = []
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        weights = Path(tmp) / f"{args.model}.safetensors"
        subprocess.run([sys.executable, __file__, "_weights", args.model, str(weights)], check=True, env=env)
        for n_img in args.images:
            h5 = Path(tmp) / f"{args.model}_{n_img}.h5"
            spec = {"model": args.model, "weights": str(weights), "images": n_img, "image_dir": args.image_dir, "out": str(h5), "batch_size": args.batch_size}
            t_ext, rss_ext = _rss_of([sys.executable, __file__, "_extract", json.dumps(spec)], env)
            kspec = {"activations": str(h5), "layers": args.kpca_layers, "chunk": args.chunk, "workers": args.threads}
            t_kpca, rss_kpca = _rss_of([sys.executable, __file__, "_kpca", json.dumps(kspec)], env)
            row = {
                "model": args.model,
                "images": n_img,
                "extract_seconds": t_ext,
                "extract_peak_rss_mb": rss_ext,
                "kpca_layers": args.kpca_layers or "all",
                "kpca_seconds": t_kpca,
                "kpca_peak_rss_mb": rss_kpca,
                "h5_mb": h5.stat().st_size / 2**20,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            h5.unlink()
    return {"command": "memory", "rows": rows}


def cmd_chain(args) -> dict:
    """Wall time of ``snakemake results/table1.csv`` from scratch in a fresh directory, per rule too."""
    import csv

    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        cfg = Path(args.configfile).resolve()
        text = cfg.read_text().replace("../shared", str((REPO / ".." / "shared").resolve()))
        (Path(tmp) / "bench.yaml").write_text(text)
        tree = Path(args.tree).resolve() if args.tree else REPO  # another checkout: compare versions
        cmd = [sys.executable, "-m", "snakemake", "-s", str(tree / "Snakefile"), "-d", tmp, "--cores", str(args.cores), *args.targets, "--configfile", str(Path(tmp) / "bench.yaml")]
        env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-4000:])
        rules = {}
        for tsv in sorted(Path(tmp, "benchmarks").rglob("*.tsv")):
            with open(tsv) as fh:
                rec = next(csv.DictReader(fh, delimiter="\t"))
            rules[str(tsv.relative_to(Path(tmp, "benchmarks")))] = {"seconds": float(rec["s"]), "max_rss_mb": float(rec["max_rss"])}
        tables = {t: Path(tmp, t).read_text() for t in args.targets if t.endswith(".csv")}
    out = {"command": "chain", "tree": str(args.tree or REPO), "targets": args.targets, "cores": args.cores, "wall_seconds": wall, "rules": rules, "tables": tables}
    print(json.dumps({"wall_seconds": wall}), flush=True)
    return out


def _authors_head(k, v) -> dict | None:
    """One head the way ``value_vectors.py`` treats it: one ``Vhat``, the oracle's Table 1
    metrics on it, plus the quantities that script also computes per head and never
    aggregates (Frobenius error, token-wise Euclidean, L1 and Pearson, Python lists of the
    per-token values and a Python loop counting negative cosines; docs/method.md 2). Their
    cost belongs to the baseline. None where the script drops the head."""
    import torch

    from kpca_tools.reference import metrics_reference, v_kpca_reference

    vhat = v_kpca_reference(k)
    try:
        out = metrics_reference(v, vhat)
    except ValueError:  # scipy on a NaN cost matrix: the script drops the head
        return None
    vn = v / (v.norm(2, dim=1, keepdim=True) + 1e-8)
    vhn = vhat / (vhat.norm(2, dim=1, keepdim=True) + 1e-8)
    direct = (vn * vhn).sum(dim=1).tolist()
    out["negative_count"] = sum(1 for c in direct if c < 0)
    out["frobenius"] = torch.norm(v - vhat, p="fro").item() / torch.norm(v, p="fro").item()
    out["euclidean"] = torch.norm(v - vhat, dim=1).tolist()
    out["l1"] = torch.sum(torch.abs(v - vhat), dim=1).tolist()
    vc, vhc = v - v.mean(dim=1, keepdim=True), vhat - vhat.mean(dim=1, keepdim=True)
    out["pearson"] = (vc / (vc.norm(dim=1, keepdim=True) + 1e-8) * (vhc / (vhc.norm(dim=1, keepdim=True) + 1e-8))).sum(dim=1).tolist()
    return out


def _authors(spec: dict) -> dict:
    """The structure of the authors' ``value_vectors.py`` for one model (docs/method.md 2 and 12),
    run in its own process: decode the images one by one, then for every layer a hook on
    ``blocks[l].attn.qkv`` and a full forward pass of all images, then a Python loop over
    images and heads. Same weights, images and preprocessing as the pipeline, torch's
    default thread count (the authors never set one)."""
    t0 = time.perf_counter()
    import numpy as np
    import pandas as pd
    import torch

    from kpca_repro.capture.vision import load_timm_model
    from kpca_repro.inputs import images as img

    model = load_timm_model(spec["model"], spec["weights"]).eval()
    records = img.list_images(spec["image_dir"], spec["layout"])
    paths = list(img.sample_images(records, spec["images"], spec["seed"])["path"])
    transform = img.paper_transform(224)
    x = torch.stack([transform(img.load_image(p)) for p in paths])
    rows = []
    for layer, block in enumerate(model.blocks):
        attn, captured = block.attn, {}
        handle = attn.qkv.register_forward_hook(lambda _m, _i, out: captured.__setitem__("qkv", out.detach().clone()))
        with torch.no_grad():
            model(x)
        handle.remove()
        qkv = captured["qkv"]
        b, n = qkv.shape[:2]
        _, k, v = qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        for i in range(b):
            for h in range(attn.num_heads):
                out = _authors_head(k[i, h], v[i, h])
                if out is not None:
                    rows.append({"layer": layer, "image": i, "head": h, **{c: out[c] for c in ("direct_cos_mean", "optimal_cos_mean", "linear_cka", "rbf_cka")}})
    df = pd.DataFrame(rows)
    table = {
        "MDC": float(df["direct_cos_mean"].max()),
        "MOC": float(df["optimal_cos_mean"].max()),
        "LCKA": float(np.mean(df["linear_cka"])),
        "KCKA": float(np.mean(df["rbf_cka"])),
    }
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"seconds_in_process": time.perf_counter() - t0, "cpu_seconds": usage.ru_utime + usage.ru_stime, "heads": len(df), "torch_threads": torch.get_num_threads(), "table1": table}


def cmd_authors(args) -> dict:
    """Wall and CPU time of the authors' structure (:func:`_authors`) as one whole process."""
    spec = {"model": args.model, "weights": args.weights, "image_dir": args.image_dir, "layout": "flat", "images": args.images, "seed": args.seed}
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "_authors", json.dumps(spec)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps({"wall_seconds": wall, **out["table1"]}), flush=True)
    return {"command": "authors", "spec": spec, "wall_seconds": wall, **out}


# --------------------------------------------------------------------------------------
# Helpers run in subprocesses by `memory`
# --------------------------------------------------------------------------------------


def _make_weights(model: str, path: str) -> None:
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    m = timm.create_model(model, pretrained=False)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, path)


def _first_images(image_dir: str, n: int):
    """The sample table of the first ``n`` JPEGs of a flat folder, in name order."""
    import pandas as pd

    files = sorted(Path(image_dir).glob("*.JPEG"))[:n]
    return pd.DataFrame({"sample_rank": range(len(files)), "dataset_index": range(len(files)), "path": [str(f) for f in files]})


def _extract(spec: dict) -> dict:
    import torch

    from kpca_repro.capture.extraction import extract_vision

    torch.set_num_threads(os.cpu_count() or 1)
    samples = _first_images(spec["image_dir"], spec["images"])
    extract_vision(spec["model"], spec["weights"], "0" * 64, samples, spec["out"], batch_size=spec["batch_size"], device=torch.device("cpu"), progress=False)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _extract_timed(spec: dict) -> dict:
    """Images per second of ``extract_vision`` alone (imports and timm's own import not timed)."""
    import timm  # noqa: F401  (imported by the model loader; its ~2 s are start-up, not extraction)
    import torch

    from kpca_repro.capture.extraction import extract_vision

    torch.set_num_threads(spec["threads"])
    samples = _first_images(spec["image_dir"], spec["images"])
    t0, c0 = time.perf_counter(), time.process_time()
    extract_vision(spec["model"], spec["weights"], "0" * 64, samples, spec["out"], batch_size=spec["batch_size"], device=torch.device("cpu"), progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"images": len(samples), "seconds": wall, "cpu_seconds": cpu, "images_per_second": len(samples) / wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def cmd_extract(args) -> dict:
    """``extract_vision`` on the real DeiT-Tiny weights, this tree and optionally another one (``--tree``), alternating."""
    rows = []
    trees = [("this", REPO)] + ([("other", Path(args.tree).resolve())] if args.tree else [])
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        for rep in range(args.repeats):
            for name, tree in trees:
                spec = {"model": args.model, "weights": args.weights, "image_dir": args.image_dir, "images": args.images, "batch_size": args.batch_size}
                spec.update(threads=args.threads, out=str(Path(tmp) / f"{name}.h5"))
                env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
                proc = subprocess.run([sys.executable, __file__, "_extract_timed", json.dumps(spec)], capture_output=True, text=True, env=env)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                row = {"tree": str(tree), "repeat": rep, **json.loads(proc.stdout.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return {"command": "extract", "rows": rows}


def cmd_concurrent(args) -> dict:
    """Several paper-variant KPCA processes at once on the same cores (one per ``--layers``
    entry), with libgomp's default spin and with ``GOMP_SPINCOUNT`` values."""
    rows = []
    base_env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    base_env["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    for spin in args.spincounts:
        env = dict(base_env) if spin == "default" else dict(base_env, GOMP_SPINCOUNT=spin)
        t0 = time.perf_counter()
        specs = [json.dumps({"activations": str(args.activations), "layers": [layer], "chunk": args.chunk, "workers": 1, "eigh_threads": "auto"}) for layer in args.layers]
        procs = [subprocess.Popen([sys.executable, __file__, "_kpca", spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for spec in specs]
        outs = []
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(err[-3000:])
            outs.append(json.loads(out.strip().splitlines()[-1]))
        row = {"gomp_spincount": spin, "processes": len(procs), "wall_seconds": time.perf_counter() - t0, "per_process": outs}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"command": "concurrent", "activations": str(args.activations), "rows": rows}


def _kpca(spec: dict) -> dict:
    import torch

    from kpca_repro.method import records

    torch.set_num_threads(1)
    if spec.get("trim"):  # hand freed heap memory back to the OS after every chunk
        import ctypes

        libc, head_metrics = ctypes.CDLL("libc.so.6"), records.head_metrics

        def trimmed(*a, **kw):
            try:
                return head_metrics(*a, **kw)
            finally:
                libc.malloc_trim(0)

        records.head_metrics = trimmed
    eigh_threads = None
    if spec.get("eigh_threads") == "auto":  # the kpca_heads rule's paper variant
        from kpca_repro.threads import torch_default_threads

        eigh_threads = torch_default_threads()
    t0 = time.perf_counter()
    out, _ = records.kpca_records(
        spec["activations"], PAPER, device=torch.device("cpu"), heads_per_chunk=spec["chunk"], layers=spec["layers"], workers=spec["workers"], eigh_threads=eigh_threads, progress=False
    )
    res = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": time.perf_counter() - t0, "heads": len(out)}
    return {**res, "eigh_threads": eigh_threads, "moc": float(out["optimal_cos_mean"].max())}


#: glibc settings compared by ``allocator``: name -> (extra environment, malloc_trim after each chunk)
ALLOCATOR_MODES = {
    "default": ({}, False),
    "malloc_trim after each chunk": ({}, True),
    "MALLOC_MMAP_THRESHOLD_=131072": ({"MALLOC_MMAP_THRESHOLD_": "131072"}, False),
}


def cmd_allocator(args) -> dict:
    """Peak RSS and time of the KPCA stage (paper variant) over more and more layers, per glibc setting.

    Tells whether the RSS growth with depth is memory the stage holds or freed heap memory that
    glibc keeps (``malloc_trim`` hands it back; a fixed mmap threshold never keeps it).
    """
    rows = []
    env0 = dict(os.environ, PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for mode, (extra, trim) in ALLOCATOR_MODES.items():
        for n_layers in args.layers:
            spec = {"activations": str(args.activations), "layers": list(range(n_layers)), "chunk": args.chunk, "workers": args.threads, "trim": trim}
            proc = subprocess.run([sys.executable, __file__, "_kpca", json.dumps(spec)], capture_output=True, text=True, env={**env0, **extra})
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            row = {"mode": mode, "layers": n_layers, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {"command": "allocator", "activations": str(args.activations), "threads": args.threads, "chunk": args.chunk, "rows": rows}


def cmd_ab(args) -> dict:
    """``head_metrics`` of this tree and of ``--tree`` on the same heads in one process, interleaved.

    On a shared virtual machine the speed of the CPU drifts by tens of percent between runs a
    minute apart (the same ``eigh`` took 1.7 to 2.3 ms per head), so two separate ``stage``
    runs cannot resolve a 10 % change. Here the other tree's ``kpca`` module is imported under
    another package name, and the two run chunk by chunk in turn over the same heads (one
    worker, one intra-op thread, the rule's ``eigh`` threads), each with its own timers for
    ``eigh`` and the assignments; the drift then falls on both alike. Also reports the largest
    difference of every per-head column between the two.
    """
    import importlib.util
    import shutil

    import numpy as np
    import torch

    from kpca_repro.activations import ActivationFile
    from kpca_repro.method import kpca as this
    from kpca_repro.method.records import baseline_noise, layer_chunks

    tmp = Path(tempfile.mkdtemp())
    shutil.copytree(Path(args.tree).resolve() / "src" / "kpca_repro", tmp / "kpca_other")
    for source in (tmp / "kpca_other").rglob("*.py"):  # absolute imports of the copy stay inside the copy
        source.write_text(re.sub(r"\bkpca_repro\b", "kpca_other", source.read_text()))
    spec = importlib.util.spec_from_file_location("kpca_other", tmp / "kpca_other" / "__init__.py", submodule_search_locations=[str(tmp / "kpca_other")])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["kpca_other"] = pkg
    spec.loader.exec_module(pkg)
    # the copied tree's engine: kpca_other.method.kpca (package by stage) or kpca_other.kpca (older, flat trees)
    other = importlib.import_module("kpca_other.method.kpca" if (tmp / "kpca_other" / "method" / "kpca.py").is_file() else "kpca_other.kpca")

    torch.set_num_threads(1)
    ks, vs, bs = [], [], []
    with ActivationFile(args.activations) as af:
        per_layer = len(af.sample_rank) * int(af.attrs["n_heads"])
        for layer, _, t in layer_chunks(af, args.layers, per_layer):
            ks.append(t["k"][: args.heads_per_layer])
            vs.append(t["v"][: args.heads_per_layer])
            if get_variant(args.variant).baselines:
                shape = (int(af.attrs["n_heads"]), *t["v"].shape[1:])
                bs.append(torch.cat([baseline_noise(0, di, layer, shape) for di in af.dataset_index])[: args.heads_per_layer])
    k, v = torch.cat(ks), torch.cat(vs)
    base = torch.cat(bs) if bs else None
    n = k.shape[0]
    eigh_threads = None
    if get_variant(args.variant).authors_threads:
        from kpca_repro.threads import torch_default_threads

        eigh_threads = torch_default_threads()
    seconds = {name: {"total": 0.0, "eigh": 0.0, "assignment": 0.0} for name in ("this", "other")}
    current = ["this"]
    real_eigh = torch.linalg.eigh

    def timed(kind, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                seconds[current[0]][kind] += time.perf_counter() - t0

        return wrapper

    torch.linalg.eigh = timed("eigh", real_eigh)
    for mod in (this, other):  # the solver lives in <package>.numerics (older trees: <package>.kpca)
        holder = getattr(sys.modules.get(mod.__name__.rsplit(".", 1)[0] + ".numerics"), "linear_sum_assignment", None) and sys.modules[mod.__name__.rsplit(".", 1)[0] + ".numerics"]
        holder = holder or mod
        holder.linear_sum_assignment = timed("assignment", holder.linear_sum_assignment)

    def run(name, mod):
        current[0] = name
        parts = []
        t0 = time.perf_counter()
        for lo in range(0, n, args.chunk):
            b = None if base is None else base[lo : lo + args.chunk]
            parts.append(mod.head_metrics(k[lo : lo + args.chunk], v[lo : lo + args.chunk], args.variant, baseline=b, **solver_kw(mod)))
        seconds[name]["total"] += time.perf_counter() - t0
        return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}

    def solver_kw(mod):
        """The eigh threads in the tree's own terms: a placement (since issue 45) or eigh_threads (before)."""
        if "placement" in inspect.signature(mod.head_metrics).parameters:
            place = importlib.import_module(mod.__name__.rsplit(".", 1)[0] + ".placement").Placement
            return {"placement": place.local("cpu", eigh_threads=eigh_threads, per_head_products=get_variant(args.variant).authors_threads)}
        return {"eigh_threads": eigh_threads}

    run("other", other)  # warm-up, not counted
    run("this", this)
    seconds = {name: dict.fromkeys(sec, 0.0) for name, sec in seconds.items()}
    for _ in range(args.repeats):
        out_other, out_this = run("other", other), run("this", this)
    torch.linalg.eigh = real_eigh
    shutil.rmtree(tmp)
    per_head = {}
    for name, sec in seconds.items():
        ms = {key: 1e3 * val / (args.repeats * n) for key, val in sec.items()}
        ms["everything_else"] = ms["total"] - ms["eigh"] - ms["assignment"]
        per_head[name] = ms
        print(json.dumps({"tree": name, "ms_per_head": {key: round(val, 3) for key, val in ms.items()}}), flush=True)
    diffs = {c: float(np.nanmax(np.abs(out_this[c].astype(float) - out_other[c].astype(float)), initial=0.0)) for c in out_this if out_this[c].dtype != bool}
    return {
        "command": "ab",
        "tree": str(Path(args.tree).resolve()),
        "variant": args.variant,
        "heads": n,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "eigh_threads": eigh_threads,
        "ms_per_head": per_head,
        "max_abs_diff": diffs,
    }


def main(argv=None) -> None:
    helpers = {"_one": _one, "_extract": _extract, "_extract_timed": _extract_timed, "_kpca": _kpca, "_authors": _authors}
    if len(sys.argv) > 2 and sys.argv[1] in helpers:
        fn = helpers[sys.argv[1]]
        print(json.dumps(fn(json.loads(sys.argv[2]))))
        return
    if len(sys.argv) > 3 and sys.argv[1] == "_weights":
        _make_weights(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("shapes", "stage", "table1"):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cpu")
        s.add_argument("--threads", type=int, default=2, help="worker threads (batched) / torch threads (per-head baseline)")
        s.add_argument("--chunk", type=int, default=16, help="heads per batched call")
        s.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
        if name == "shapes":
            s.add_argument("--baseline-heads", type=int, default=48, help="heads the per-head baseline runs (it is slow)")
            s.add_argument("--max-heads", type=int, default=384, help="cap on the batched heads per shape (smoke runs)")
        if name == "stage":
            s.add_argument("activations", type=Path)
        if name in ("stage", "table1"):
            s.add_argument("--eigh-device", default=None, help="cpu: eigh on the CPU for CUDA inputs (the kpca_heads rule's placement on a GPU)")
            s.add_argument("--breakdown", action="store_true", help="time the batched run spends in eigh, the assignments and head_metrics, summed over threads")
        if name in ("stage", "shapes"):
            s.add_argument("--baseline-threads", type=int, default=None, help="torch threads of the per-head baseline (default: 1 and --threads)")
        if name == "stage":
            s.add_argument("--skip-baseline", action="store_true", help="time the batched method only")
            s.add_argument("--eigh-threads", default=None, help="'auto': the kpca_heads rule's eigh threads (torch's default for the paper variant); an int; default: the caller's (one)")
        if name == "table1":
            s.add_argument("--images", type=int, default=1)
            s.add_argument("--streams", action="store_true", help="one CUDA stream per worker thread")
    s = sub.add_parser("memory")
    s.add_argument("--model", default="vit_large_patch16_224")
    s.add_argument("--images", type=int, nargs="+", default=[4, 16])
    s.add_argument("--image-dir", default=str(REPO / ".." / "shared" / "assets" / "images" / "imagenet-sample"))
    s.add_argument("--batch-size", type=int, default=25)
    s.add_argument("--kpca-layers", type=int, nargs="*", default=None, help="layers the KPCA run covers (default: all)")
    s.add_argument("--chunk", type=int, default=16)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--tmpdir", default=None)
    s = sub.add_parser("allocator")
    s.add_argument("activations", type=Path)
    s.add_argument("--layers", type=int, nargs="+", default=[1, 12], help="first n layers the KPCA run covers")
    s.add_argument("--chunk", type=int, default=64, help="heads per chunk (the rule's default kpca.heads_per_chunk)")
    s.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("authors", help="the authors' value_vectors.py structure, one whole process (the chain's baseline)")
    s.add_argument("--model", default="deit_tiny_patch16_224")
    s.add_argument("--weights", default=str(REPO / ".." / "shared" / "assets" / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"))
    s.add_argument("--image-dir", default=str(REPO / ".." / "shared" / "assets" / "images" / "imagenet-sample"))
    s.add_argument("--images", type=int, default=100)
    s.add_argument("--seed", type=int, default=0, help="the configuration seed of the image draw")
    s = sub.add_parser("extract", help="images/s of extract_vision on the real DeiT-Tiny weights")
    s.add_argument("--model", default="deit_tiny_patch16_224")
    s.add_argument("--weights", default=str(REPO / ".." / "shared" / "assets" / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"))
    s.add_argument("--image-dir", default=str(REPO / ".." / "shared" / "assets" / "images" / "imagenet-sample"))
    s.add_argument("--images", type=int, default=100)
    s.add_argument("--batch-size", type=int, default=25)
    s.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the forward pass")
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--tree", default=None, help="another checkout to compare with (its src/)")
    s.add_argument("--tmpdir", default=None)
    s = sub.add_parser("concurrent", help="paper-variant KPCA processes at once on the same cores, by GOMP_SPINCOUNT")
    s.add_argument("activations", type=Path)
    s.add_argument("--layers", type=int, nargs="+", default=[0, 1], help="one process per layer")
    s.add_argument("--chunk", type=int, default=16)
    s.add_argument("--spincounts", nargs="+", default=["3000", "default"], help="GOMP_SPINCOUNT values; 'default': libgomp's own")
    s = sub.add_parser("ab", help="head_metrics of this tree against another (--tree) on the same heads, interleaved in one process")
    s.add_argument("activations", type=Path)
    s.add_argument("--tree", required=True, help="the other checkout (its src/kpca_repro is imported as kpca_other)")
    s.add_argument("--variant", default=PAPER.name, choices=VARIANTS)
    s.add_argument("--layers", type=int, nargs="+", default=[0, 3, 6, 9, 11])
    s.add_argument("--heads-per-layer", type=int, default=120, help="the first heads of each layer")
    s.add_argument("--chunk", type=int, default=64, help="heads per head_metrics call (the rule's default kpca.heads_per_chunk)")
    s.add_argument("--repeats", type=int, default=3)
    s = sub.add_parser("chain")
    s.add_argument("--configfile", default=str(REPO / "config" / "offline_deit_tiny.yaml"))
    s.add_argument("--cores", type=int, default=2)
    s.add_argument("--targets", nargs="+", default=["results/table1.csv"])
    s.add_argument("--tree", default=None, help="run another checkout's Snakefile and src/ (default: this one)")
    s.add_argument("--tmpdir", default=None)
    for s in sub.choices.values():
        s.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    result = {"environment": _environment(), "argv": sys.argv[1:], **globals()[f"cmd_{args.command}"](args)}
    result["environment"]["loadavg_1min_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
