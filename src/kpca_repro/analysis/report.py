"""HTML renderings of the result tables for ``snakemake --report`` (which shows HTML inline)."""

from __future__ import annotations

import html
import os

import numpy as np
import pandas as pd

__all__ = ["table_html"]

_STYLE = (
    "<style>table{border-collapse:collapse;font:13px sans-serif}th,td{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}td:first-child,th:first-child{text-align:left}</style>"
)


def _format(x) -> str:
    if isinstance(x, (float, np.floating)):
        if not np.isfinite(x):
            return ""
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
    return str(x)


def table_html(csv_path: str | os.PathLike, title: str) -> str:
    """A self-contained HTML page with the table of ``csv_path``.

    Floats are shown with 3 decimals (1 above 100), NaN as an empty cell; long hashes
    (``weights_sha256``) are shortened to their first 12 characters.

    Args:
        csv_path: a results table (``results/table1.csv``, ...).
        title: heading of the page.

    Returns:
        The HTML text.

    Raises:
        FileNotFoundError: ``csv_path`` does not exist.
    """
    frame = pd.read_csv(csv_path)
    for col in frame.columns:
        if col.endswith("sha256"):
            frame[col] = frame[col].astype(str).str[:12] + "…"
    body = frame.to_html(index=False, na_rep="", formatters={c: _format for c in frame.columns}, border=0)
    return f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>{_STYLE}</head><body><h3>{html.escape(title)}</h3>{body}</body></html>\n"
