"""What perf/bench.py and perf/memory.py share: the machine, child processes, the JSON result,
and the KPCA methods the ``shapes`` and ``stage`` benchmarks compare.

Not a benchmark itself: the benchmarks import it as ``_bench`` (Python puts ``perf/`` first on
the path when it runs a script there); it puts ``tools/`` on the path for the per-head baseline
:mod:`kpca_tools.reference` (a test tool, never installed: tools/README.md).

A benchmark's result file (``--out``) is one JSON object: ``environment`` (:func:`environment`,
with ``loadavg_1min_at_end`` added when the measurement ends), ``argv`` (the benchmark's own
arguments) and what its measurement returns, starting with ``command`` (the subcommand's name,
whose table ``python perf/bench.py report`` prints).

Methods compared (each measurement runs in its own subprocess, so peak RSS is its own):

``per_head`` (paper variant)
    ``tools/kpca_tools/reference.py``: the per-head transcription of the authors' ``value_vectors.py``
    (docs/method.md Section 12): one ``eigh``, one CKA helper call per CKA, one assignment per head,
    Python loops over heads. It is the test oracle of the batched code and is imported, not
    copied, so the baseline stays independent of what it measures.
``per_head`` (corrected variant)
    :func:`kpca_repro.method.kpca.head_metrics` called on one head at a time.
``batched``
    What the ``kpca_heads`` rule runs: chunks of ``--chunk`` heads through ``head_metrics``,
    ``--threads`` chunks at a time on worker threads (:func:`kpca_repro.workers.ordered_map`),
    one intra-op torch thread on the CPU.

Every comparison also checks that the methods produce the same numbers (``max_abs_diff``:
largest difference over the per-head columns both produce).

The children (:func:`measure` and :func:`records_child` start them)::

    python perf/_bench.py _heads   SPEC_JSON   # one method on a set of heads: seconds, heads/s, peak RSS (and GPU memory)
    python perf/_bench.py _records SPEC_JSON   # kpca_records over some layers of an activation file: seconds, peak RSS
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the per-head baseline (kpca_tools.reference) is a test tool, never installed (tools/README.md)
sys.path.insert(0, str(REPO / "tools"))

from kpca_repro.method.variant import PAPER, VARIANTS  # noqa: E402
from kpca_repro.method.variant import get as get_variant  # noqa: E402

#: The offline inputs beside the checkout (README.md: ``../shared/assets``).
ASSETS = REPO / ".." / "shared" / "assets"
#: The 1000-image sample, the default of the benchmarks that read images.
IMAGE_DIR = ASSETS / "images" / "imagenet-sample"


def timed(fn: Callable, record: Callable[[float], None]) -> Callable:
    """``fn`` wrapped so that the wall seconds of every call go to ``record`` (also when it raises).

    The breakdowns (``bench.py stage --breakdown``, ``ab``, ``job``) wrap the engine's
    functions with it; ``record`` decides where the seconds go (a lock for worker threads, a tree).
    """

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            record(time.perf_counter() - t0)

    return wrapper


def environment() -> dict:
    """The machine a measurement ran on: Python and torch versions, CPUs, 1-minute load average, GPU name."""
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


def child_env(tree: Path = REPO, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with ``tree``'s ``src/`` first on ``PYTHONPATH``."""
    return dict(os.environ if base is None else base, PYTHONPATH=f"{tree / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def last_json(stdout: str) -> dict:
    """The last line a child printed, parsed as JSON (a child's result; its progress lines come before)."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_child(script: Path | str, helper: str, spec: dict, env: dict | None = None) -> dict:
    """Run ``python SCRIPT HELPER JSON(spec)`` (:func:`serve_child` on the other side) and return its result.

    Each measurement runs in its own interpreter, so its peak RSS and its imports are its own.
    Raises ``RuntimeError`` with the end of the child's stderr if the child fails.
    """
    proc = subprocess.run([sys.executable, str(script), helper, json.dumps(spec)], capture_output=True, text=True, env=child_env() if env is None else env)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {helper} {spec} failed:\n{proc.stderr[-3000:]}")
    return last_json(proc.stdout)


def serve_child(helpers: dict[str, Callable[[dict], dict]]) -> bool:
    """If this process was started as ``SCRIPT HELPER JSON`` (:func:`run_child`) with ``HELPER`` in
    ``helpers``: run it on the decoded spec, print its result as one JSON line and return True."""
    if len(sys.argv) > 2 and sys.argv[1] in helpers:
        print(json.dumps(helpers[sys.argv[1]](json.loads(sys.argv[2]))))
        return True
    return False


def first_images(image_dir: str, n: int):
    """The sample table of the first ``n`` JPEGs of a flat folder, in name order."""
    import pandas as pd

    files = sorted(Path(image_dir).glob("*.JPEG"))[:n]
    return pd.DataFrame({"sample_rank": range(len(files)), "dataset_index": range(len(files)), "path": [str(f) for f in files]})


def finish(args: argparse.Namespace, measure: Callable[[argparse.Namespace], dict], argv: list[str] | None = None) -> dict:
    """Run ``measure(args)`` and write the result file (module docstring) to ``args.out`` if given."""
    result = {"environment": environment(), "argv": sys.argv[1:] if argv is None else list(argv), **measure(args)}
    result["environment"]["loadavg_1min_at_end"] = os.getloadavg()[0]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


# --------------------------------------------------------------------------------------
# The KPCA methods compared
# --------------------------------------------------------------------------------------

#: The per-head columns of Table 1's metrics, the ones the authors' per-head transcription produces.
PAPER_COLUMNS = ("direct_cos_mean", "direct_cos_max", "direct_cos_min", "optimal_cos_mean", "optimal_cos_max", "linear_cka", "rbf_cka")


def random_heads(n_heads: int, n: int, d: int, seed: int = 0, baseline: bool = True):
    """Keys and values of ViT-like magnitude (``s k.k`` of order 1-10) and a baseline draw.

    Returns ``(k, v, base)``: float32 ``(n_heads, n, d)`` keys and values, float64 ``(n_heads, n, d)``
    baseline noise (``(n_heads, 0)`` zeros when ``baseline`` is False).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_heads, n, d, generator=gen) * 1.5 + torch.randn(n_heads, 1, d, generator=gen)
    v = torch.randn(n_heads, n, d, generator=gen)
    base = torch.randn(n_heads, n, d, generator=gen, dtype=torch.float64) if baseline else torch.zeros(n_heads, 0)
    return k, v, base


def read_file(path, variant, seed):
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


# --------------------------------------------------------------------------------------
# The methods
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


def _batched(k, v, base, variant, device, chunk, workers, eigh_device=None, eigh_threads=None):
    import dataclasses

    import numpy as np
    import torch

    from kpca_repro.method import kpca
    from kpca_repro.method.placement import plan
    from kpca_repro.workers import ordered_map

    # the job's placement, with the solver's device as asked (eigh_device "cpu": LAPACK per matrix beside a GPU)
    place = plan(variant, device=str(device), cores=workers, eigh_threads=eigh_threads)
    if eigh_device is not None:
        solver = torch.device(eigh_device)
        place = dataclasses.replace(place, eigh_device=solver, eigh_batched=solver.type != "cpu")

    def work(lo):
        hi = min(lo + chunk, k.shape[0])
        b = base[lo:hi].to(device) if get_variant(variant).baselines else None
        return kpca.head_metrics(k[lo:hi].to(device), v[lo:hi].to(device), variant, baseline=b, placement=place)

    parts = list(ordered_map(work, range(0, k.shape[0], chunk), workers=workers, blas_threads=place.blas_threads))
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}


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
    return _batched(k, v, base, spec["variant"], device, spec["chunk"], spec["workers"], spec.get("eigh_device"), eigh_threads)


# --------------------------------------------------------------------------------------
# One measurement (runs in a child process)
# --------------------------------------------------------------------------------------


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
        def record(dt):
            with self.lock:
                self.seconds[name] += dt
                self.calls[name] += 1

        return timed(fn, record)

    def install(self):
        import torch

        from kpca_repro.method import kpca, numerics

        torch.linalg.eigh = self.wrap("eigh", torch.linalg.eigh)
        numerics.linear_sum_assignment = self.wrap("assignment", numerics.linear_sum_assignment)
        kpca.head_metrics = self.wrap("head_metrics", kpca.head_metrics)

    def reset(self):
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0


def _heads_child(spec: dict) -> dict:
    """Run one (method, variant, shape, device) measurement; write its outputs to spec['npz']."""
    import numpy as np
    import torch

    torch.set_num_threads(spec["torch_threads"])
    device = torch.device(spec["device"])
    if spec.get("activations"):
        k, v, base = read_file(spec["activations"], spec["variant"], spec.get("seed", 0))
    else:  # one draw of `draw` heads; the baseline takes its first `heads`
        k, v, base = random_heads(spec.get("draw", spec["heads"]), spec["n"], spec["d"], baseline=get_variant(spec["variant"]).baselines)
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
    res = {"seconds": wall, "heads": int(k.shape[0]), "heads_per_second": k.shape[0] / wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
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


def measure(spec: dict, tmp: Path) -> tuple[dict, dict]:
    """Run ``spec`` in a fresh interpreter; return (timing, outputs).

    ``spec``: ``method`` (``per_head`` or ``batched``), ``variant``, ``device``, ``torch_threads``,
    and either ``activations`` (a file, :func:`read_file`) or ``n``, ``d``, ``heads`` (and
    ``draw``) for :func:`random_heads`; the batched method also ``chunk`` and ``workers``
    (optional: ``eigh_device``, ``eigh_threads``, ``breakdown``). Timing: ``seconds``
    (wall), ``heads``, ``heads_per_second``, ``peak_rss_mb`` (``peak_gpu_mb`` on CUDA; ``breakdown``
    if asked, :class:`_Timers`). Outputs: the per-head columns as numpy arrays.
    """
    import numpy as np

    spec = dict(spec, npz=str(tmp / f"out_{os.getpid()}_{time.monotonic_ns()}.npz"))
    res = run_child(__file__, "_heads", spec)
    with np.load(spec["npz"]) as z:
        out = {c: z[c] for c in z.files}
    return res, out


def _max_abs_diff(a: dict, b: dict, columns=None) -> float:
    import numpy as np

    cols = [c for c in (columns or a) if c in a and c in b]
    diffs = [np.nanmax(np.abs(a[c].astype(float) - b[c].astype(float)), initial=0.0) for c in cols]
    return float(max(diffs)) if diffs else float("nan")


def compare(base_out: dict, fast_out: dict) -> dict:
    """How far the batched outputs ``fast_out`` are from the per-head baseline's ``base_out``.

    Against the authors' per-head oracle (no ``dropped`` column; NaN where it drops a head):
    ``max_abs_diff`` over :data:`PAPER_COLUMNS` of the heads both keep and ``same_dropped_heads``.
    Otherwise ``max_abs_diff`` over every column and ``bit_identical``.
    """
    import numpy as np

    if "dropped" not in base_out:  # the authors' per-head oracle: NaN where the reference drops a head
        ok = np.isfinite(base_out["linear_cka"])
        same_dropped = bool(np.array_equal(~ok, fast_out["dropped"].astype(bool)))
        sub = lambda o: {c: o[c][ok] for c in PAPER_COLUMNS}  # noqa: E731
        return {"max_abs_diff": _max_abs_diff(sub(base_out), sub(fast_out)), "same_dropped_heads": same_dropped}
    identical = all(np.array_equal(base_out[c], fast_out[c], equal_nan=True) for c in base_out)
    return {"max_abs_diff": _max_abs_diff(base_out, fast_out), "bit_identical": identical}


# --------------------------------------------------------------------------------------
# The KPCA stage over some layers (runs in a child process)
# --------------------------------------------------------------------------------------


def _records_child(spec: dict) -> dict:
    import torch

    from kpca_repro.method import records
    from kpca_repro.method.placement import plan

    torch.set_num_threads(1)
    eigh_threads = None
    if spec.get("eigh_threads") == "auto":  # the kpca_heads rule's paper variant
        from kpca_repro.threads import torch_default_threads

        eigh_threads = torch_default_threads()
    t0 = time.perf_counter()
    place = plan(PAPER, device="cpu", cores=spec["workers"], eigh_threads=eigh_threads)
    out, _, _ = records.kpca_records(spec["activations"], records.KpcaJob(PAPER, place, heads_per_chunk=spec["chunk"], layers=spec["layers"]))
    res = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": time.perf_counter() - t0, "heads": len(out)}
    return {**res, "eigh_threads": eigh_threads, "moc": float(out["optimal_cos_mean"].max())}


def records_child(spec: dict, env: dict | None = None) -> dict:
    """The KPCA stage in a child process: :func:`kpca_repro.method.records.kpca_records`, paper
    variant, on the CPU with one intra-op thread, over ``spec``'s ``activations`` file and
    ``layers``, ``chunk`` heads per chunk on ``workers`` threads (``eigh_threads`` ``"auto"``:
    the rule's). Returns ``peak_rss_mb``, ``seconds``, ``heads``, ``eigh_threads``, ``moc`` (the
    largest matched cosine); ``RuntimeError`` if the child fails."""
    return run_child(__file__, "_records", spec, env=env)


def add_method_args(p, variants: bool = True) -> None:
    """The options of the benchmarks that run :func:`measure`: ``--device``, ``--threads``, ``--chunk`` (and ``--variants``)."""
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="worker threads (batched) / torch threads (per-head baseline)")
    p.add_argument("--chunk", type=int, default=16, help="heads per batched call")
    if variants:
        p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)


if __name__ == "__main__":
    serve_child({"_heads": _heads_child, "_records": _records_child})
