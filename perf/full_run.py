"""Time and peak memory per model of one run of the default target, from its Snakemake benchmarks.

    python perf/full_run.py BENCHMARKS_DIR MODEL_ID [MODEL_ID ...]

BENCHMARKS_DIR is the ``benchmarks/`` folder of a finished run (one TSV per job, written by the
rules' ``benchmark:``). A job belongs to a model when its benchmark path names the model's id
(timm) or slug (``org--name``, Hugging Face); the other jobs (the image and WikiText downloads,
the sentence and image draws, the tables, figures and report) are summed on a last row.

Printed: one Markdown row per model with the number of jobs, the sum of their wall seconds
(``s``) and of their CPU seconds (``cpu_time``), the largest peak resident memory of any of them (``max_rss``, MiB, printed in GiB) and which job that
was, then the shared row and the total. Used for docs/hub_fixture.md ("The full paper
configuration").
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from kpca_repro.inputs.model_info import model_slug


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


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    models = argv[1:]
    jobs = per_model(read_benchmarks(Path(argv[0])), models)
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
