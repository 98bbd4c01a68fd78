"""Per-head agreement of the paper variant with the authors' per-head loops (docs/fidelity.md).

Runs ``kpca_records`` as the ``kpca_heads`` rule does (one intra-op thread, 2 workers,
``heads_per_chunk`` 64) with ``eigh`` on torch's default thread count and, for comparison, on
the caller's single thread; then the transcription of ``value_vectors.py`` (vision files) or
``nlp_value_vectors.py`` (text files) from ``tools/kpca_tools/reference.py`` on every selected
head with torch's default threads. Prints, per setting, the heads beyond tolerance (1e-5;
RBF CKA 1e-4) and the largest difference per metric.

    python tools/fidelity_check.py results/activations/deit_tiny_patch16_224/vision_100_0of1.h5 --layers 9 --inputs 40

With ``--authors``, joins instead a pipeline run's per-head records (``results/heads/paper/<model>/*.csv``)
with the ``head_level_stats.csv`` that the authors' script wrote for the same seed on the same
machine (``nlp_value_vectors.py``: rows by ``(layer, sample, head)``; ``value_vectors.py``:
``sample`` is the loader's batch row, mapped to the pipeline's ``sample_rank`` through the
``SubsetRandomSampler`` order of ``--seed``), and prints the same summary per metric:

    python tools/fidelity_check.py --authors nlp_value_vectors_outputs/<model>/statistics/head_level_stats.csv results/heads/paper/<model>/text_100_0of1.csv
    python tools/fidelity_check.py --authors value_vectors_outputs/<model>/statistics/head_level_stats.csv --seed 1 results/heads/paper/<model>/vision_100_0of1.csv
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kpca_repro.activations import ActivationFile
from kpca_repro.method.placement import plan
from kpca_repro.method.records import KpcaJob, kpca_records
from kpca_repro.method.variant import PAPER
from kpca_repro.threads import intra_op_threads, torch_default_threads
from kpca_tools.reference import head_metrics_reference, head_metrics_reference_nlp, sampler_order

METRICS = ("direct_cos_mean", "direct_cos_max", "optimal_cos_mean", "optimal_cos_max", "linear_cka", "rbf_cka")
#: The authors' head_level_stats.csv columns -> the pipeline's record columns (Table 4's script, then Table 1's).
AUTHORS_COLUMNS = {
    "nlp": {
        "mean_similarity": "direct_cos_mean",
        "max_similarity": "direct_cos_max",
        "optimal_similarity": "optimal_cos_mean",
        "max_optimal_similarity": "optimal_cos_max",
        "linear_cka": "linear_cka",
        "kernel_cka": "rbf_cka",
    },
    "vision": {"direct_similarity": "direct_cos_mean", "optimal_similarity": "optimal_cos_mean", "linear_cka": "linear_cka", "kernel_cka": "rbf_cka"},
}


def tolerance(metric: str) -> float:
    """The per-head tolerance of docs/fidelity.md: 1e-4 for RBF CKA, 1e-5 otherwise."""
    return 1e-4 if metric == "rbf_cka" else 1e-5


def compare_with_authors(authors_csv: str, records_csvs: list[str], seed: int, n_images: int, population: int | None = None) -> dict:
    """Join the authors' per-head output with pipeline records on ``(layer, sample_rank, head)``.

    Args:
        authors_csv: ``head_level_stats.csv`` of ``nlp_value_vectors.py`` or ``value_vectors.py``
            (recognised by its columns).
        records_csvs: the pipeline's per-head record CSVs of the same model and sample (all shards).
        seed: the run's seed (vision: the loader's batch order, :func:`kpca_tools.reference.sampler_order`).
        n_images: the number of sampled images (vision), 100 in the paper.
        population: the images in the authors' ImageFolder. When it equals ``n_images`` their
            script draws nothing (``random.sample`` only runs for a larger folder) and its
            indices are the folder's order, so its rows are joined on ``dataset_index``.

    Returns:
        ``{"heads": joined heads, "authors_only": heads missing from the records,
        "beyond": heads beyond tolerance, "per_metric": {metric: (heads beyond, max |difference|)}}``.
        A head where both sides are NaN agrees; NaN on one side only counts as beyond.
    """
    import pandas as pd

    authors = pd.read_csv(authors_csv)
    kind = "nlp" if "max_optimal_similarity" in authors.columns else "vision"
    columns = AUTHORS_COLUMNS[kind]
    authors = authors[["layer", "sample", "head", *columns]].rename(columns={a: "authors_" + m for a, m in columns.items()})
    records = pd.concat([pd.read_csv(p) for p in records_csvs])
    if kind == "vision":  # batch row b of the authors' loader is the draw's perm[b]-th image
        perm = sampler_order(seed, n_images)
        authors["sample"] = [perm[b] for b in authors["sample"]]
        if population is not None and population == n_images:  # no draw: perm[b] is a folder index
            records = records.drop(columns="sample_rank").rename(columns={"dataset_index": "sample_rank"})
    records = records.rename(columns={"sample_rank": "sample"})
    joined = authors.merge(records[["layer", "sample", "head", *columns.values()]], on=["layer", "sample", "head"], how="left", indicator=True)
    beyond = np.zeros(len(joined), dtype=bool)
    per_metric = {}
    for metric in columns.values():
        a, p = joined["authors_" + metric].to_numpy(float), joined[metric].to_numpy(float)
        diff = np.where(np.isnan(a) & np.isnan(p), 0.0, np.abs(a - p))
        bad = ~(diff <= tolerance(metric))  # NaN on one side only: beyond
        beyond |= bad
        per_metric[metric] = (int(bad.sum()), float(np.nanmax(diff)) if len(diff) else 0.0)
    return {"heads": len(joined), "authors_only": int((joined["_merge"] != "both").sum()), "beyond": int(beyond.sum()), "per_metric": per_metric}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("activations", nargs="+", help="an activation file; with --authors, the per-head record CSVs")
    ap.add_argument("--layers", default="0", help="comma-separated layers")
    ap.add_argument("--inputs", type=int, default=10, help="the first N images or sentences of the file")
    ap.add_argument("--authors", help="the authors' head_level_stats.csv: join it with the record CSVs instead")
    ap.add_argument("--seed", type=int, default=0, help="with --authors: the run's seed (vision batch order)")
    ap.add_argument("--n-images", type=int, default=100, help="with --authors: sampled images (vision)")
    args = ap.parse_args()
    if args.authors:
        res = compare_with_authors(args.authors, args.activations, args.seed, args.n_images)
        print(f"{res['heads']} heads of the authors' output, {res['authors_only']} not in the records, {res['beyond']} beyond tolerance; per metric (heads beyond, max |difference|):")
        for metric, (n, worst) in res["per_metric"].items():
            print(f"  {metric}: {n}, {worst:.2e}")
        return
    args.activations = args.activations[0]
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
            records[label], _, _ = kpca_records(
                args.activations, KpcaJob(PAPER, placement=plan(PAPER, device=torch.device("cpu"), cores=2, eigh_threads=eigh_threads), heads_per_chunk=64, layers=layers)
            )
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
