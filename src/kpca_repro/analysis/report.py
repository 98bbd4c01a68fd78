"""HTML renderings of the result tables for ``snakemake --report`` (which shows HTML inline)."""

from __future__ import annotations

import html
import json
import os

import numpy as np
import pandas as pd

__all__ = ["SIGNIFICANT_DIGITS", "format_number", "caption_html", "table_html"]

_STYLE = (
    "<style>table{border-collapse:collapse;font:13px sans-serif}th,td{border:1px solid #ccc;padding:3px "
    "6px;text-align:right}th{background:#eee}"
    "td:first-child,th:first-child{text-align:left}th[title]{text-decoration:underline dotted}dl{font:13px "
    "sans-serif}dt{font-weight:bold;margin-top:4px}</style>"
)

#: Significant digits of a float in the HTML tables (an eigengap of 8.4e-7 must not print as 0.000).
SIGNIFICANT_DIGITS = 3


def format_number(x) -> str:
    """A table cell: a float to :data:`SIGNIFICANT_DIGITS` significant digits, anything else as ``str``.

    ``0.14393`` -> ``0.144``, ``0.000212`` -> ``0.000212``, ``8.38e-07`` -> ``8.38e-07``,
    ``6.4973`` -> ``6.50``, ``326.8`` -> ``327``; a float from 1000 to 1e6 keeps its integer
    digits (``1104.5`` -> ``1105``, not ``1.10e+03``); 0 is ``0``; NaN and ±inf an empty cell.
    """
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (float, np.floating)):
        return str(x)
    if not np.isfinite(x):
        return ""
    if x == 0:
        return "0"
    text = f"{x:#.{SIGNIFICANT_DIGITS}g}"
    if "e+" in text and abs(x) < 1e6:
        return f"{x:.0f}"
    return text.removesuffix(".")


def _descriptions(metadata_path: str | os.PathLike | None) -> dict[str, str]:
    """Column name -> ``description (unit)`` from a CSVW metadata file (:mod:`kpca_repro.analysis.columns`), or {}."""
    if metadata_path is None:
        return {}
    with open(metadata_path, encoding="utf-8") as fh:
        columns = json.load(fh)["tableSchema"]["columns"]
    return {c["name"]: f"{c['dc:description']} ({c['schema:unitText']})" for c in columns}


def caption_html(rst: str) -> str:
    """The HTML body of the reST text ``rst`` (a table's caption, :attr:`kpca_repro.analysis.tables.Table.caption`).

    Raises:
        docutils.utils.SystemMessage: ``rst`` has a docutils warning or error (an undefined
            ``|substitution|``, unclosed inline markup), which would otherwise print as a red box in the page.
    """
    from docutils.core import publish_parts
    from docutils.writers import html5_polyglot

    return publish_parts(
        rst,
        writer=html5_polyglot.Writer(),
        settings_overrides={"halt_level": 2, "report_level": 2, "_disable_config": True},
    )["body"]


def _interval(lo, hi) -> str:
    """``[lo, hi]`` (:func:`format_number` each), or "" when either end is missing or not finite."""
    ends = [format_number(lo), format_number(hi)]
    return f"[{ends[0]}, {ends[1]}]" if all(ends) else ""


def _folded(frame: pd.DataFrame, described: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """The columns of ``frame`` as the page shows them one per row: ``(name, tooltip, cells)``, each
    ``X`` with ``X_lower`` and ``X_upper`` as one cell ``value [lower, upper]``, and a pair
    ``P_lower``, ``P_upper`` without ``P`` (``MDC_solver_lower``, ``MDC_solver_upper``) as one cell ``[lower, upper]``
    named ``P``."""
    out, done = [], set()
    for c in frame.columns:
        if c in done:
            continue
        base = c.removesuffix("_lower")
        if base != c and f"{base}_upper" in frame and base not in frame:  # an interval alone
            done.add(f"{base}_upper")
            tip = " / ".join(filter(None, (described.get(c), described.get(f"{base}_upper"))))
            out.append((base, tip, [_interval(lo, hi) for lo, hi in zip(frame[c], frame[f"{base}_upper"])]))
        elif f"{c}_lower" in frame and f"{c}_upper" in frame:  # a value and its interval
            done |= {f"{c}_lower", f"{c}_upper"}
            tip = " / in brackets: ".join(filter(None, (described.get(c), described.get(f"{c}_lower"))))
            cells = [
                " ".join(filter(None, (format_number(v), _interval(lo, hi))))
                for v, lo, hi in zip(frame[c], frame[f"{c}_lower"], frame[f"{c}_upper"])
            ]
            out.append((c, tip, cells))
        else:
            out.append((c, described.get(c, ""), [format_number(v) for v in frame[c]]))
    return out


def table_html(
    csv_path: str | os.PathLike,
    title: str,
    metadata_path: str | os.PathLike | None = None,
    caption: str = "",
    headline: pd.DataFrame | None = None,
    note: str = "",
    by_column: bool = False,
) -> str:
    """A self-contained HTML page with the table of ``csv_path``: the report's view of a table.

    Floats keep :data:`SIGNIFICANT_DIGITS` significant digits (:func:`format_number`), NaN is an
    empty cell; long hashes (``weights_sha256``) are shortened to their first 12 characters.
    With ``metadata_path`` (the CSVW ``<csv>-metadata.json`` beside the CSV), every column's
    description is its header's tooltip and, under the table, a legend.

    With ``by_column`` (a table of one row per model), every column of the CSV is shown one per
    row (one column per row of the CSV, headed by its first column), each statistic with its
    interval in one cell (``X``, ``X_lower``, ``X_upper`` as ``value [lower, upper]``): a page as
    wide as the models, not as the CSV's columns. ``headline`` (the paper's columns as text cells,
    :func:`kpca_repro.analysis.rendering.paper_cells`) and ``note`` come before it.

    Args:
        csv_path: a results table (``results/table1.csv``, ...).
        title: heading of the page.
        metadata_path: the table's column metadata, or None (no tooltips, no legend).
        caption: reST printed between the heading and the table (:func:`caption_html`); "" for none.
        headline: str cells shown first, or None.
        note: text under ``headline``.
        by_column: the CSV one column per row (implied by ``headline``); False: the CSV as it is, one row per row.

    Returns:
        The HTML text.

    Raises:
        FileNotFoundError: ``csv_path`` or ``metadata_path`` does not exist.
        docutils.utils.SystemMessage: a docutils warning or error in ``caption``.
    """
    frame = pd.read_csv(csv_path)
    for col in frame.columns:
        if col.endswith("sha256"):
            frame[col] = frame[col].astype(str).str[:12] + "…"
    described = _descriptions(metadata_path)
    esc = html.escape

    def th(name: str, tip: str) -> str:
        return f'<th title="{esc(tip)}">{esc(name)}</th>' if tip else f"<th>{esc(name)}</th>"

    body = caption_html(caption) if caption else ""
    if headline is not None:
        header = "".join(th(c, described.get(c, "")) for c in headline.columns)
        rows = "".join(
            "<tr>" + "".join(f"<td>{esc(str(x))}</td>" for x in row) + "</tr>"
            for row in headline.itertuples(index=False)
        )
        body += (
            f"<table><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>"
            + (f"<p>{esc(note)}</p>" if note else "")
            + "<h4>Every column</h4>"
        )
    if headline is None and not by_column:
        header = "".join(th(c, described.get(c, "")) for c in frame.columns)
        rows = "".join(
            "<tr>" + "".join(f"<td>{esc(format_number(x))}</td>" for x in row) + "</tr>"
            for row in frame.itertuples(index=False)
        )
        body += f"<table><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>"
    else:
        heads = "".join(f"<th>{esc(str(x))}</th>" for x in frame.iloc[:, 0])
        rows = "".join(
            "<tr>" + th(name, tip) + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>"
            for name, tip, cells in _folded(frame.iloc[:, 1:], described)
        )
        body += (
            f"<table><thead><tr>{th(frame.columns[0], described.get(frame.columns[0], ''))}{heads}</tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
    if described:
        body += (
            "<h4>Columns</h4><dl>"
            + "".join(f"<dt>{esc(c)}</dt><dd>{esc(described[c])}</dd>" for c in frame.columns if c in described)
            + "</dl>"
        )
    return (
        "<!DOCTYPE html><html><head><meta "
        f"charset='utf-8'><title>{esc(title)}</title>{_STYLE}</head><body><h3>{esc(title)}</h3>{body}</body></html>\n"
    )
