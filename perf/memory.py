"""Host memory and time: of one model's extraction and KPCA over growing image counts, of one
extraction batch by batch, and per model of a finished run.

    python perf/memory.py models [--model vit_large_patch16_224] [--images 4 16 100] [--kpca-layers 0 1 2 3]
                                 [--image-dir DIR] [--batch-size 25] [--chunk 16] [--threads 2] [--tmpdir DIR] [--out memory.json]
    python perf/memory.py extract WEIGHTS IMAGE_DIR MODEL_ID N_IMAGES [--batch-size 25] [--threads 2]
    python perf/memory.py run BENCHMARKS_DIR MODEL_ID [MODEL_ID ...]
    python perf/memory.py heads RUN_DIR

``models``
    For each ``--images`` count, in their own processes: ``extract_vision`` of the first images
    of ``--image-dir`` (a flat folder of JPEGs) with the model's random weights, on all CPU
    cores, then the paper variant's KPCA stage (``kpca_records``) over ``--kpca-layers``
    (default: all) of the file it wrote: seconds and peak RSS of each, and the file's size.
``extract``
    ``extract_vision`` (the rule's code) on the CPU over the first ``N_IMAGES`` images of the
    flat folder ``IMAGE_DIR`` into a temporary HDF5 file; one line per batch: the resident
    memory (RSS, GiB, after a garbage collection) when the captured batch is handed to the
    HDF5 writer, then the peak RSS. The writer holds one batch while the next is computed, so
    from the second batch on two batches of q, k, v, h are in memory: the peak depends on the
    batch size, not on ``N_IMAGES``.
``run``
    ``BENCHMARKS_DIR`` is the ``benchmarks/`` folder of a finished run (one TSV per job, from
    the rules' ``benchmark:``). A job belongs to a model when its path names the model's id
    (timm) or slug (``org--name``, Hugging Face); the other jobs (downloads, draws, tables,
    figures, report) are summed on a last row. Prints one Markdown row per model: jobs, wall
    and CPU seconds summed over its jobs, the largest peak RSS and its job; then the shared
    row and the total.
``heads``
    ``RUN_DIR`` is the working directory of a finished run. Per KPCA job (rules ``kpca_heads``
    and ``kpca_prefix``: a decoder's full-prefix view and its prefix profile, docs/method.md 16):
    the heads of its records (``results/heads/...csv``), their mean token count, wall seconds and
    peak RSS from its ``benchmark:`` file, and the seconds per 1,000 heads.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench, also when this file is imported by path (tests)

import _bench  # noqa: E402

# --------------------------------------------------------------------------------------
# models: extraction and KPCA of one model, growing image counts
# --------------------------------------------------------------------------------------


def _make_weights(spec: dict) -> dict:
    """Random weights of ``spec['model']`` (seed 0) saved as safetensors at ``spec['path']``."""
    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    m = timm.create_model(spec["model"], pretrained=False)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, spec["path"])
    return {}


def _extract(spec: dict) -> dict:
    import torch

    from kpca_repro.capture.extraction import extract_vision

    torch.set_num_threads(os.cpu_count() or 1)
    samples = _bench.first_images(spec["image_dir"], spec["images"])
    extract_vision(spec["model"], spec["weights"], "0" * 64, samples, spec["out"], batch_size=spec["batch_size"], device=torch.device("cpu"), progress=False)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _timed(run, *a, **kw) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    t0 = time.perf_counter()
    res = run(*a, **kw)
    return time.perf_counter() - t0, res["peak_rss_mb"]


def models(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        weights = Path(tmp) / f"{args.model}.safetensors"
        _bench.run_child(__file__, "_weights", {"model": args.model, "path": str(weights)})
        for n_img in args.images:
            h5 = Path(tmp) / f"{args.model}_{n_img}.h5"
            spec = {"model": args.model, "weights": str(weights), "images": n_img, "image_dir": args.image_dir, "out": str(h5), "batch_size": args.batch_size}
            t_ext, rss_ext = _timed(_bench.run_child, __file__, "_extract", spec)
            kspec = {"activations": str(h5), "layers": args.kpca_layers, "chunk": args.chunk, "workers": args.threads}
            t_kpca, rss_kpca = _timed(_bench.records_child, kspec)
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


def models_table(r):
    print("| model | images | extraction s | extraction peak RSS MB | KPCA layers | KPCA s | KPCA peak RSS MB | HDF5 MB |\n|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(
            f"| {row['model']} | {row['images']} | {row['extract_seconds']:.0f} | {row['extract_peak_rss_mb']:.0f} | {row['kpca_layers']} | {row['kpca_seconds']:.0f} | {row['kpca_peak_rss_mb']:.0f} | {row['h5_mb']:.0f} |"
        )


# --------------------------------------------------------------------------------------
# extract: one extraction, batch by batch
# --------------------------------------------------------------------------------------


def extract(args) -> None:
    import psutil
    import torch

    import kpca_repro.capture.extraction as extraction
    from kpca_repro.activations import ActivationWriter
    from kpca_repro.inputs.images import list_images
    from kpca_repro.inputs.resources import check_checksum

    records = list_images(args.image_dir, "flat")[: args.n_images]
    if len(records) < args.n_images:
        raise SystemExit(f"{args.image_dir} has {len(records)} images, fewer than {args.n_images}")
    samples = pd.DataFrame({"sample_rank": range(len(records)), "dataset_index": [r.dataset_index for r in records], "path": [r.path for r in records]})
    torch.set_num_threads(args.threads)

    add = ActivationWriter.add

    def add_and_report(writer, layers, mask=None):
        gc.collect()
        print(f"batch at image {writer.rows}: RSS {psutil.Process().memory_info().rss / 2**30:.2f} GiB", flush=True)
        return add(writer, layers, mask)

    ActivationWriter.add = add_and_report
    with tempfile.TemporaryDirectory() as tmp:
        extraction.extract_vision(args.model_id, args.weights, check_checksum(args.weights, None), samples, Path(tmp) / "a.h5", batch_size=args.batch_size, device=torch.device("cpu"), progress=False)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


# --------------------------------------------------------------------------------------
# run: time and peak memory per model of a finished run
# --------------------------------------------------------------------------------------


def read_benchmarks(directory: Path) -> pd.DataFrame:
    """One row per job: ``path`` (relative to ``directory``), ``rule``, ``s`` (wall seconds),
    ``cpu_s`` (CPU seconds of the job's processes, Snakemake's ``cpu_time``), ``max_rss`` (MB)."""
    rows = []
    for f in sorted(directory.rglob("*.tsv")):
        b = pd.read_csv(f, sep="\t")
        rss = pd.to_numeric(b["max_rss"], errors="coerce").max()
        cpu = pd.to_numeric(b["cpu_time"], errors="coerce").sum() if "cpu_time" in b else float("nan")
        rows.append({"path": str(f.relative_to(directory)), "rule": Path(f.relative_to(directory).parts[0]).stem, "s": float(b["s"].sum()), "cpu_s": float(cpu), "max_rss": rss})
    return pd.DataFrame(rows)


def owner(path: str, models: list[str]) -> str | None:
    from kpca_repro.inputs.model_info import model_slug

    """The model whose id or slug is a component of ``path`` (longest match first), else None."""
    parts = Path(path).with_suffix("").parts
    stems = set(parts) | {p.split(".")[0] for p in parts}
    for m in sorted(models, key=len, reverse=True):
        if m in stems or model_slug(m) in stems:
            return m
    return None


def per_model(jobs: pd.DataFrame, models: list[str]) -> pd.DataFrame:
    """``jobs`` (:func:`read_benchmarks`) with a ``model`` column: the owning model id (:func:`owner`), or None for
    the jobs no model owns (downloads of images and WikiText, draws, tables, figures, report)."""
    return jobs.assign(model=[owner(p, models) for p in jobs["path"]])


def run(args) -> None:
    models = args.models
    jobs = per_model(read_benchmarks(args.benchmarks), models)
    print("| model | jobs | wall time, sum over its jobs | CPU time, sum | peak RSS (largest job) | largest job |")
    print("|---|---:|---:|---:|---:|---|")
    for m in models:
        j = jobs[jobs["model"] == m]
        if j.empty:
            print(f"| {m} | 0 | – | – | – | – |")
            continue
        top = j.loc[j["max_rss"].idxmax()]
        print(f"| {m} | {len(j)} | {j['s'].sum():,.0f} s | {j['cpu_s'].sum():,.0f} s | {top['max_rss'] / 1024:.2f} GiB | {top['rule']} |")
    rest = jobs[jobs["model"].isna()]
    if not rest.empty:
        top = rest.loc[rest["max_rss"].idxmax()]
        print(f"| shared jobs ({', '.join(sorted(set(rest['rule'])))}) | {len(rest)} | {rest['s'].sum():,.0f} s | {rest['cpu_s'].sum():,.0f} s | {top['max_rss'] / 1024:.2f} GiB | {top['rule']} |")
    print(f"| **all** | {len(jobs)} | {jobs['s'].sum():,.0f} s | {jobs['cpu_s'].sum():,.0f} s | {jobs['max_rss'].max() / 1024:.2f} GiB | |")


def heads(args) -> None:
    root = args.run_dir
    print("| job | heads | mean tokens | wall time | per 1,000 heads | peak RSS |")
    print("|---|---:|---:|---:|---:|---:|")
    for rule in ("kpca_heads", "kpca_prefix"):
        for bench in sorted((root / "benchmarks" / rule).rglob("*.tsv")):
            stem = bench.relative_to(root / "benchmarks" / rule).with_suffix("")
            records = pd.read_csv(root / "results" / "heads" / f"{stem}.csv")
            b = pd.read_csv(bench, sep="\t")
            sec, n = float(b["s"].sum()), len(records)
            per = f"{sec / n * 1000:,.1f} s" if n else "–"
            tokens = f"{records['n_tokens'].mean():.1f}" if n else "–"
            print(f"| {rule} {stem} | {n:,} | {tokens} | {sec:,.1f} s | {per} | {pd.to_numeric(b['max_rss'], errors='coerce').max():,.0f} MB |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("models", help="extraction and KPCA of one model (random weights), growing image counts")
    sp.add_argument("--model", default="vit_large_patch16_224")
    sp.add_argument("--images", type=int, nargs="+", default=[4, 16])
    sp.add_argument("--image-dir", default=str(_bench.IMAGE_DIR))
    sp.add_argument("--batch-size", type=int, default=25)
    sp.add_argument("--kpca-layers", type=int, nargs="*", default=None, help="layers the KPCA run covers (default: all)")
    sp.add_argument("--chunk", type=int, default=16)
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--tmpdir", default=None)
    sp.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    sp = sub.add_parser("extract", help="one extraction's memory, batch by batch")
    sp.add_argument("weights", type=Path, help="safetensors state_dict of the timm model")
    sp.add_argument("image_dir", type=Path, help="folder of images (*.JPEG, *.jpg, *.png)")
    sp.add_argument("model_id", help="timm model id, e.g. vit_large_patch16_224")
    sp.add_argument("n_images", type=int)
    sp.add_argument("--batch-size", type=int, default=25, help="vision.batch_size (default 25, the configuration's)")
    sp.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    sp = sub.add_parser("run", help="time and peak memory per model of a finished run")
    sp.add_argument("benchmarks", type=Path, help="the run's benchmarks/ folder")
    sp.add_argument("models", nargs="+")
    sp = sub.add_parser("heads", help="time and peak memory per 1,000 heads of each KPCA job of a finished run")
    sp.add_argument("run_dir", type=Path, help="the run's working directory (results/, benchmarks/)")
    args = p.parse_args(argv)
    if args.command == "heads":
        heads(args)
    elif args.command == "models":
        models_table(_bench.finish(args, models, argv))
    elif args.command == "extract":
        extract(args)
    else:
        run(args)


if __name__ == "__main__":
    if not _bench.serve_child({"_weights": _make_weights, "_extract": _extract}):
        main()
