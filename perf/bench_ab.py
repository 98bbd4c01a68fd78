"""``head_metrics`` of this tree against another checkout (``--tree``) on the same real heads, interleaved in one process.

    python perf/bench_ab.py ACTIVATIONS.h5 --tree OTHER_CHECKOUT [--variant paper] [--layers 0 3 6 9 11]
                            [--heads-per-layer 120] [--chunk 64] [--repeats 3] [--out ab.json]

On a shared virtual machine the speed of the CPU drifts by tens of percent between runs a
minute apart (the same ``eigh`` took 1.7 to 2.3 ms per head), so two separate ``bench_stage.py``
runs cannot resolve a 10 % change. Here the other tree's ``kpca`` module is imported under
another package name (:func:`import_other`), and the two run chunk by chunk in turn over the
same heads (one worker, one intra-op thread, the rule's ``eigh`` threads), each with its own
timers for ``eigh`` and the assignments (:class:`TreeTimers`); the drift then falls on both
alike. Reports milliseconds per head of each tree (``total``, ``eigh``, ``assignment``,
``everything_else``) and the largest difference of every per-head column between the two.
Writes ``{"command": "ab", "tree", "variant", "heads", "chunk", "repeats", "eigh_threads",
"ms_per_head", "max_abs_diff"}`` (perf/_bench.py: the result file).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import _bench

from kpca_repro.method.variant import PAPER, VARIANTS
from kpca_repro.method.variant import get as get_variant


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


def measure(args) -> dict:
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


def main(argv=None) -> dict:
    p = _bench.parser(__doc__)
    p.add_argument("activations", type=Path)
    p.add_argument("--tree", required=True, help="the other checkout (its src/kpca_repro is imported as kpca_other)")
    p.add_argument("--variant", default=PAPER.name, choices=VARIANTS)
    p.add_argument("--layers", type=int, nargs="+", default=[0, 3, 6, 9, 11])
    p.add_argument("--heads-per-layer", type=int, default=120, help="the first heads of each layer")
    p.add_argument("--chunk", type=int, default=64, help="heads per head_metrics call (the rule's default kpca.heads_per_chunk)")
    p.add_argument("--repeats", type=int, default=3)
    return _bench.main(p, measure, argv)


if __name__ == "__main__":
    main()
