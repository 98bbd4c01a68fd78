"""Per-head agreement of the paper variant with the authors' per-head loops (docs/fidelity.md).

Runs ``kpca_records`` as the ``kpca_heads`` rule does (one intra-op thread, 2 workers,
``heads_per_chunk`` 64) with ``eigh`` on torch's default thread count and, for comparison, on
the caller's single thread; then the transcription of ``value_vectors.py`` (vision files) or
``nlp_value_vectors.py`` (text files) from ``tests/paper_reference.py`` on every selected
head with torch's default threads. Prints, per setting, the heads beyond tolerance (1e-5;
RBF CKA 1e-4) and the largest difference per metric.

    python perf/fidelity_check.py results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --layers 9 --inputs 40
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kpca_repro.h5io import ActivationFile  # noqa: E402
from kpca_repro.kpca import intra_op_threads  # noqa: E402
from kpca_repro.records import kpca_records  # noqa: E402
from kpca_repro.threads import torch_default_threads  # noqa: E402

from paper_reference import head_metrics_reference, head_metrics_reference_nlp  # noqa: E402

METRICS = ("direct_cos_mean", "direct_cos_max", "optimal_cos_mean", "optimal_cos_max", "linear_cka", "rbf_cka")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("activations")
    ap.add_argument("--layers", default="0", help="comma-separated layers")
    ap.add_argument("--inputs", type=int, default=10, help="the first N images or sentences of the file")
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    with ActivationFile(args.activations) as af:
        text = af.attention_mask is not None
        n_heads = int(af.attrs["n_heads"])
    reference = head_metrics_reference_nlp if text else head_metrics_reference
    threads = torch_default_threads()
    records = {}
    with intra_op_threads(1):
        for label, eigh_threads in ((f"eigh on {threads} threads (default)", threads), ("eigh on 1 thread", None)):
            t0 = time.perf_counter()
            records[label], _ = kpca_records(args.activations, "paper", device=torch.device("cpu"), layers=layers, workers=2, heads_per_chunk=64, eigh_threads=eigh_threads, progress=False)
            print(f"{label}: records of {len(records[label])} heads in {time.perf_counter() - t0:.1f} s", flush=True)
    worst = {label: dict.fromkeys(METRICS, 0.0) for label in records}
    beyond = dict.fromkeys(records, 0)
    compared = 0
    with ActivationFile(args.activations) as af, intra_op_threads(threads):
        for layer in layers:
            t = af.read(layer, ("k", "v"), images=slice(0, args.inputs))
            for i in range(t["k"].shape[0]):
                for h in range(n_heads):
                    ref = reference(torch.from_numpy(t["k"][i, h]), torch.from_numpy(t["v"][i, h]))
                    if ref is None:  # dropped by the vision reference
                        continue
                    compared += 1
                    for label, recs in records.items():
                        row = recs[recs["layer"] == layer].iloc[i * n_heads + h]
                        diff = {m: abs(float(row[m]) - ref[m]) for m in METRICS if m in ref and np.isfinite(ref[m])}
                        for m, d in diff.items():
                            worst[label][m] = max(worst[label][m], d)
                        beyond[label] += any(d > (1e-4 if m == "rbf_cka" else 1e-5) for m, d in diff.items())
    for label in records:
        print(f"{label}: {compared} heads compared, {beyond[label]} beyond tolerance; max |difference|:", {m: float(f"{v:.2e}") for m, v in worst[label].items()})


if __name__ == "__main__":
    main()
