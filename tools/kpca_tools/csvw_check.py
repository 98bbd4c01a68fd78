"""The CSVW check of a run's results: every CSV under ``results/``, the method's records included, has ``<name>.csv-metadata.json``
beside it (:mod:`kpca_repro.analysis.columns`; the records' from rule records_metadata), and a CSVW validator accepts each metadata file with
its CSV: the check ``csvwvalidate`` (the ``csvw`` package) makes, ``csvw.CSVW(url, validate=True,
strict=True)``, called in-process (one child per file would cost a second each).

Used by tests/test_columns.py and the workflow tests; needs ``csvw`` (the test extra).
"""

from __future__ import annotations

import warnings
from pathlib import Path

__all__ = ["metadata_problems", "results_problems"]


def metadata_problems(meta: str | Path) -> list[str]:
    """What a CSVW validator finds wrong with one ``<name>.csv-metadata.json`` and its CSV: [] when
    ``csvwvalidate`` would print OK; else its messages (at most five), each prefixed with the file's name.

    Raises:
        ModuleNotFoundError: csvw is not installed.
    """
    from csvw import CSVW

    meta = Path(meta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # csvw repeats each problem as a warning; its list below holds them
        try:
            table = CSVW(str(meta), validate=True, strict=True)
        except ValueError as exc:  # csvwvalidate's exit status 2: metadata it cannot read
            return [f"{meta.name}: {exc}"]
    if table.is_valid:
        return []
    return [f"{meta.name}: {w.message}" for w in table.warnings[:5]] or [f"{meta.name}: not valid"]


def results_problems(results: str | Path) -> list[str]:
    """Every CSV under ``results`` without its metadata file, and :func:`metadata_problems` of every ``*.csv-metadata.json`` under it (a metadata file without
    its CSV fails there too)."""
    results = Path(results)
    missing = [f"{csv.relative_to(results)}: no {csv.name}-metadata.json beside it" for csv in sorted(results.rglob("*.csv")) if not csv.with_name(csv.name + "-metadata.json").exists()]
    return missing + [p for meta in sorted(results.rglob("*.csv-metadata.json")) for p in metadata_problems(meta)]
