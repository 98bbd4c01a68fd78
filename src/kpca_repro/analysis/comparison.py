"""Every published number of Tables 1-4 beside the reproduced one (the reproduction report).

The published numbers are read from a directory of CSV files (config key
``comparison.published_tables``), one per table of :data:`kpca_repro.analysis.tables.TABLES`
(its ``published`` file: columns ``model``, the id column and the compared ones,
``Table.compared``). The default, ``builtin`` (:data:`BUILTIN`), is the copy shipped inside
this package as package data, :data:`BUILTIN_DIR` = ``kpca_repro/data/paper_tables`` (source:
Sarıtaş & Yıldız, arXiv:2505.07908, Tables 1-4; its README.md); a path names another directory
in the same layout; ``null`` turns the comparison off.

An empty cell is a number the source does not give (unreadable). The number of decimals
of each published cell sets the rounding used to decide whether the reproduction matches.

Every published number gets one status (docs/uncertainty.md), in this order of the rows:
:data:`WITHIN_ROUNDING`, :data:`CONSISTENT`, :data:`DIFFERS` (or their sampling-only forms
:data:`CONSISTENT_SAMPLING`, :data:`DIFFERS_SAMPLING`; the model ran), then
:data:`NOT_COMPARABLE`, then :data:`NOT_RUN` and :data:`NOT_PUBLISHED`; the ``reason``
column says why for the last three.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pandas as pd

from kpca_repro.analysis.rendering import markdown_table
from kpca_repro.analysis.tables import TABLES, Table

__all__ = [
    "BUILTIN",
    "BUILTIN_DIR",
    "resolve_published_dir",
    "MATCH",
    "WITHIN_ROUNDING",
    "CONSISTENT",
    "DIFFERS",
    "CONSISTENT_SAMPLING",
    "DIFFERS_SAMPLING",
    "NOT_COMPARABLE",
    "NOT_RUN",
    "STAND_IN_REASON",
    "USER_ACTIVATIONS_REASON",
    "mark_user_activations",
    "NOT_PUBLISHED",
    "STATUS_ORDER",
    "not_comparable_reason",
    "read_published",
    "published_model_ids",
    "not_run_reason",
    "decimals",
    "status",
    "compare_table",
    "comparison_table",
    "comparison_markdown",
]

WITHIN_ROUNDING = "within rounding"
#: The published value (widened by its rounding) overlaps the reproduced cell's interval, an
#: interval that varies the sample and the solver (eigenvector signs and rotations inside
#: near-degenerate eigenspaces; MDC and MOC of Tables 1 and 4, docs/uncertainty.md).
CONSISTENT = "consistent with sampling and solver variation"
DIFFERS = "differs beyond sampling and solver variation"
#: The same for an interval that varies the sample only (the bootstrap of LCKA, KCKA and
#: Tables 2-3; and MDC / MOC of a table without solver draws): a status claims only what
#: its interval covers.
CONSISTENT_SAMPLING = "consistent with sampling variation"
DIFFERS_SAMPLING = "differs beyond sampling variation"
#: The model ran, but not as published: built with ``vision.model_kwargs``, weights whose
#: SHA-256 is not the one in config ``checksums``, or a non-finite reproduced value.
NOT_COMPARABLE = "not comparable"
NOT_RUN = "not run"
#: The reason of a stand-in's rows (config ``comparison.stand_in_models``).
#: The reason of the rows of a model analysed from user activations (config ``activations:``).
USER_ACTIVATIONS_REASON = (
    "user activations, not comparable (config activations:, docs/activations.md): a user's q, k, v, h, not the "
    "paper's model and sample"
)
STAND_IN_REASON = (
    "stand-in weights (random weights of the exact architecture, config comparison.stand_in_models): never "
    "compared with the paper"
)
NOT_PUBLISHED = "not published"
#: Former name of :data:`WITHIN_ROUNDING`.
MATCH = WITHIN_ROUNDING
#: Row groups, in the order of the comparison table.
STATUS_ORDER = {
    WITHIN_ROUNDING: 0,
    CONSISTENT: 0,
    DIFFERS: 0,
    CONSISTENT_SAMPLING: 0,
    DIFFERS_SAMPLING: 0,
    NOT_COMPARABLE: 1,
    NOT_RUN: 2,
    NOT_PUBLISHED: 2,
}


#: Value of config ``comparison.published_tables`` naming the copy of the paper's tables shipped
#: with this package (the default). A directory literally called ``builtin`` is ``./builtin``.
BUILTIN = "builtin"
#: That copy: the CSV files of the tables' ``published`` and a README.md naming their
#: source, installed with the package (pyproject ``[tool.setuptools.package-data]``), so the
#: comparison needs no file outside the package, whatever the working directory.
BUILTIN_DIR = Path(__file__).resolve().parents[1] / "data" / "paper_tables"


def resolve_published_dir(value: str | os.PathLike | None) -> Path | None:
    """The directory a ``comparison.published_tables`` value names.

    Args:
        value: the string :data:`BUILTIN` (the packaged copy, :data:`BUILTIN_DIR`), a
            directory path (relative paths resolve from the working directory; a ``Path`` is
            always a directory), or None / ``""`` (no comparison).

    Returns:
        The directory, or None for no comparison. Existence is not checked here: a missing
        file reads as an absent table (:func:`read_published`), and the workflow refuses a
        missing directory at start-up (``kpca_repro.workflow.config_checks``).
    """
    if value is None or str(value) == "":
        return None
    # only the configuration's string means the packaged copy: Path("./builtin") is a directory
    return BUILTIN_DIR if isinstance(value, str) and value == BUILTIN else Path(value)


def read_published(directory: str | os.PathLike | None, table: Table) -> pd.DataFrame | None:
    """One published table with every cell as text (so its decimals are kept), or None if absent.

    ``directory`` is a ``comparison.published_tables`` value (:func:`resolve_published_dir`):
    :data:`BUILTIN`, a path, or None; ``table`` an entry of :data:`~kpca_repro.analysis.tables.TABLES`
    (None also for one without a ``published`` file).
    """
    resolved = resolve_published_dir(directory)
    path = resolved / table.published if resolved is not None and table.published else None
    if path is None or not path.is_file():
        return None
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def published_model_ids(directory: str | os.PathLike | None) -> dict[str, str]:
    """Model id -> ``"vision"`` (a ``timm_id`` column) or ``"text"`` (``hf_id``), over all published tables.

    ``directory``: a ``comparison.published_tables`` value (:func:`resolve_published_dir`).
    """
    out: dict[str, str] = {}
    for table in TABLES.values():
        frame = read_published(directory, table)
        if frame is not None:
            for model_id in frame[table.id_column]:
                out.setdefault(model_id, table.domain)
    return out


def not_run_reason(model_id: str, kind: str, configured: list[str], weights_file: str | os.PathLike | None) -> str:
    """Why a published model has no reproduced row: not configured, and whether its weights are missing.

    Args:
        model_id: timm or Hugging Face id.
        kind: ``"vision"`` or ``"text"`` (names the config key ``vision.models`` / ``text.models``).
        configured: the model ids of that config key.
        weights_file: where the weights would be read offline, or None if unknown.
    """
    if model_id in configured:
        return "configured, but its table has no row for it"
    reason = f"not in config {kind}.models"
    if weights_file is not None and not os.path.exists(weights_file):
        reason += f"; weights unavailable ({weights_file} missing)"
    return reason


def decimals(cell: str) -> int:
    """Number of decimals a published cell is printed with (``"0.09"`` -> 2, ``"147"`` -> 0)."""
    cell = cell.strip()
    return len(cell.split(".", 1)[1]) if "." in cell else 0


def status(
    published: str, reproduced: float, lower: float = float("nan"), upper: float = float("nan"), solver: bool = True
) -> str:
    """The statistical status of one published number.

    * :data:`WITHIN_ROUNDING`: ``|reproduced - published| <=`` half a unit of the published
      cell's last decimal (``0.005`` for ``"0.31"``, ``0.5`` for ``"325"``) plus 1e-9;
    * :data:`CONSISTENT`: otherwise, the published value's rounding range
      ``[published - half unit, published + half unit]`` overlaps the reproduced cell's
      interval ``[lower, upper]`` (bootstrap over images or sentences, combined with
      solver variation for MDC and MOC: signs and rotations);
    * :data:`DIFFERS`: otherwise, including when no finite interval is given.

    ``solver`` False (an interval that varies the sample only): :data:`CONSISTENT_SAMPLING`
    and :data:`DIFFERS_SAMPLING` instead, so that the status claims only what was varied.

    Raises:
        ValueError: ``published`` is empty or ``reproduced`` is not finite (callers give those
            rows their own status).
    """
    if not published.strip() or not math.isfinite(reproduced):
        raise ValueError("status needs a published cell and a finite reproduced value")
    half = 0.5 * 10.0 ** (-decimals(published)) + 1e-9
    value = float(published)
    if abs(reproduced - value) <= half:
        return WITHIN_ROUNDING
    if math.isfinite(lower) and math.isfinite(upper) and lower - half <= value <= upper + half:
        return CONSISTENT if solver else CONSISTENT_SAMPLING
    return DIFFERS if solver else DIFFERS_SAMPLING


def not_comparable_reason(
    model_id: str, model_kwargs: dict, checksums: dict, weights_sha256: str | None, stand_ins=()
) -> str | None:
    """Why a model that ran cannot be set beside the paper's number, or None (issue 16 item 4).

    Not comparable when (0) the model is in ``stand_ins`` (config ``comparison.stand_in_models``):
    its weights are random weights of the exact architecture (docs/hub_fixture.md), an untrained
    network the paper never measured; or (1) ``model_kwargs[model_id]`` is a non-empty mapping: the model was
    built with ``vision.model_kwargs`` and is not the published architecture; or (2)
    ``checksums`` has an entry for the model and the SHA-256 recorded with the reproduced
    table (``weights_sha256``, copied from the activation file) differs from it. A table
    without a recorded SHA-256 (Tables 2-3) is not a mismatch: with a ``checksums`` entry the
    extraction refuses other weights. A model without a ``checksums`` entry is compared
    (its weights are unverified; Tables 1 and 4 show their SHA-256).
    """
    if model_id in set(stand_ins or ()):
        return STAND_IN_REASON
    if model_kwargs.get(model_id):
        return f"built with config vision.model_kwargs {dict(model_kwargs[model_id])}: not the published architecture"
    expected = checksums.get(model_id)
    if expected and weights_sha256 and weights_sha256 != "nan":
        if str(weights_sha256).lower() != str(expected).lower():
            return (
                f"weights SHA-256 {str(weights_sha256)[:12]}... is not {str(expected)[:12]}... of config "
                f"checksums.{model_id}"
            )
    return None


def _lookup(frame: pd.DataFrame | None, id_column: str, model_id: str, column: str, cast=float, missing=float("nan")):
    """``cast`` of the ``column`` cell of ``model_id``'s row, or ``missing`` (no frame, column or row)."""
    if frame is None or id_column not in frame or column not in frame:
        return missing
    hit = frame.loc[frame[id_column] == model_id, column]
    return cast(hit.iloc[0]) if len(hit) else missing


def _lookup_long(frame: pd.DataFrame | None, id_column: str, model_id: str, column: str) -> float:
    if frame is None or "column" not in frame:
        return _lookup(frame, id_column, model_id, column)
    hit = frame.loc[(frame[id_column] == model_id) & (frame["column"] == column), "paper_statistic_value"]
    return float(hit.iloc[0]) if len(hit) else float("nan")


def compare_table(
    table: Table,
    published: pd.DataFrame | None,
    reproduced: pd.DataFrame | None,
    corrected: pd.DataFrame | None,
    not_run: dict[str, str],
    source: str,
    model_kwargs: dict | None = None,
    checksums: dict | None = None,
    stand_ins=(),
) -> pd.DataFrame:
    """One row per published cell of one table, with its interval and status.

    Columns: ``table, model, model_id, column, published, reproduced, lower, upper,
    solver_lower, solver_upper, corrected, difference, status, reason, source``. ``lower`` and
    ``upper`` are the reproduced table's ``<column>_lower`` / ``<column>_upper`` (bootstrap,
    combined with the solver variation for MDC and MOC), ``solver_lower`` / ``solver_upper``
    its ``<column>_solver_*`` bounds (MDC, MOC: eigenvector signs and rotations inside
    near-degenerate eigenspaces); NaN where the table has none.

    Args:
        table: which table (an entry of :data:`~kpca_repro.analysis.tables.TABLES`), and how its
            columns map (``Table.compared``).
        published: the published table as text (:func:`read_published`), or None.
        reproduced: the pipeline's paper-variant table (``results/table<N>.csv``), or None.
        corrected: the corrected table (``results/table<N>_corrected.csv``), or None.
        not_run: model id -> why it was not run; used for models absent from ``reproduced``.
        source: where the published numbers come from (recorded in every row).
        model_kwargs, checksums, stand_ins: config ``vision.model_kwargs``, ``checksums`` and
            ``comparison.stand_in_models`` (:func:`not_comparable_reason`).

    Returns:
        ``difference`` = reproduced - published; ``status`` one of the six statuses
        (module docstring), ``reason`` why for not comparable / not run / not published.
    """
    if published is None:
        return pd.DataFrame()
    id_column, rows = table.id_column, []
    for _, pub in published.iterrows():
        model_id = pub[id_column]
        ran = reproduced is not None and id_column in reproduced and (reproduced[id_column] == model_id).any()
        incomparable = (
            not_comparable_reason(
                model_id,
                model_kwargs or {},
                checksums or {},
                _lookup(reproduced, id_column, model_id, "weights_sha256", str, None),
                stand_ins,
            )
            if ran
            else None
        )
        for col, (rep_col, cor_col) in table.compared.items():
            cell = pub.get(col, "")
            cells = _reproduced_cell(reproduced, id_column, model_id, rep_col)
            st, reason = _cell_status(cell, cells, ran, incomparable, not_run.get(model_id, "model not configured"))
            pub_value = float(cell) if cell.strip() else float("nan")
            rows.append(
                {
                    "table": table.title,
                    "model": pub["model"],
                    "model_id": model_id,
                    "column": col,
                    "published": pub_value,
                    **cells,
                    "corrected": _lookup_long(corrected, id_column, model_id, cor_col),
                    "difference": cells["reproduced"] - pub_value,
                    "status": st,
                    "reason": reason,
                    "source": source,
                }
            )
    return pd.DataFrame(rows)


def _reproduced_cell(reproduced: pd.DataFrame | None, id_column: str, model_id: str, column: str) -> dict[str, float]:
    """One model's value of ``column`` in the paper-variant table with its intervals: ``reproduced``,
    ``lower``, ``upper`` (``<column>_lower`` / ``_upper``) and ``solver_lower``, ``solver_upper``
    (``<column>_solver_*``); NaN where the table has none (no table, row or column)."""
    cells = {"reproduced": _lookup(reproduced, id_column, model_id, column)}
    cells.update({b: _lookup(reproduced, id_column, model_id, f"{column}_{b}") for b in ("lower", "upper")})
    cells.update(
        {f"solver_{b}": _lookup(reproduced, id_column, model_id, f"{column}_solver_{b}") for b in ("lower", "upper")}
    )
    return cells


def _cell_status(
    cell: str, cells: dict[str, float], ran: bool, incomparable: str | None, not_run_reason: str
) -> tuple[str, str]:
    """``(status, reason)`` of one published cell (the module docstring's statuses, in their order of precedence).

    Args:
        cell: the published cell as printed ('' when the source does not give it).
        cells: the reproduced value and its intervals (:func:`_reproduced_cell`).
        ran: the model has a row in the reproduced table.
        incomparable: why the model that ran is not comparable (:func:`not_comparable_reason`), or None.
        not_run_reason: why the model did not run (used when ``ran`` is False).
    """
    rep, lower, upper = cells["reproduced"], cells["lower"], cells["upper"]
    if not cell.strip():
        return NOT_PUBLISHED, "cell unreadable in the source"
    if not ran:
        return NOT_RUN, not_run_reason
    if incomparable:
        return NOT_COMPARABLE, incomparable
    if not math.isfinite(rep):
        return NOT_COMPARABLE, "reproduced value is not finite"
    # the interval varies the solver only where the table has solver bounds (MDC, MOC)
    solver = math.isfinite(cells["solver_lower"]) and math.isfinite(cells["solver_upper"])
    st = status(cell, rep, lower, upper, solver)
    if st in (DIFFERS, DIFFERS_SAMPLING) and not (math.isfinite(lower) and math.isfinite(upper)):
        return st, "no interval in the reproduced table"
    return st, ""


COLUMNS = [
    "table",
    "model",
    "model_id",
    "column",
    "published",
    "reproduced",
    "lower",
    "upper",
    "solver_lower",
    "solver_upper",
    "corrected",
    "difference",
    "status",
    "reason",
    "source",
]


def comparison_table(
    published_dir: str | os.PathLike | None,
    results: dict[str, tuple[str | None, str | None]],
    not_run: dict[str, str],
    model_kwargs: dict | None = None,
    checksums: dict | None = None,
    stand_ins=(),
) -> pd.DataFrame:
    """The whole comparison: every published number of the tables of :data:`~kpca_repro.analysis.tables.TABLES`.

    Args:
        published_dir: a ``comparison.published_tables`` value: :data:`BUILTIN`, a directory
            of the published CSVs (module docstring), or None (no comparison).
        results: table name (``"table1"``, ...) -> (paper-variant CSV path or None,
            corrected CSV path or None); a missing or None path counts as "not run".
        not_run: model id -> reason it was not run.
        model_kwargs, checksums, stand_ins: config ``vision.model_kwargs``, ``checksums`` and
            ``comparison.stand_in_models`` (:func:`not_comparable_reason`).

    Returns:
        The rows of :func:`compare_table`, those that ran first (by table), then the not
        comparable ones, then not run / not published (:data:`STATUS_ORDER`, stable); empty
        (with the columns) when no published table is available.
    """
    frames = []
    directory = resolve_published_dir(published_dir)
    for table in (t for t in TABLES.values() if t.published):
        published = read_published(directory, table)
        paper_csv, corrected_csv = results.get(table.name, (None, None))
        reproduced = pd.read_csv(paper_csv) if paper_csv and os.path.exists(paper_csv) else None
        corrected = pd.read_csv(corrected_csv) if corrected_csv and os.path.exists(corrected_csv) else None
        if directory is None:
            where = "not configured"
        elif directory == BUILTIN_DIR:  # named, not by its install path (which differs between machines)
            where = f"kpca_repro built-in copy, data/paper_tables/{table.published}"
        else:
            where = str(directory / table.published)
        source = f"arXiv:2505.07908 {table.title} ({where})"
        frames.append(
            compare_table(table, published, reproduced, corrected, not_run, source, model_kwargs, checksums, stand_ins)
        )
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    out = pd.concat(frames, ignore_index=True)
    order = np.argsort(out["status"].map(STATUS_ORDER).to_numpy(), kind="stable")
    return out.iloc[order].reset_index(drop=True)


def comparison_markdown(table: pd.DataFrame) -> str:
    """Markdown of the comparison (no source column), numbers to 3 significant decimals."""
    if not len(table):
        return (
            "No published tables were compared (config key comparison.published_tables is null, or names a "
            "directory without them).\n"
        )
    shown = table.drop(columns=["source"]).copy()
    for col in ("published", "reproduced", "lower", "upper", "solver_lower", "solver_upper", "corrected", "difference"):
        if col in shown:
            shown[col] = [("" if not np.isfinite(x) else f"{x:.3f}" if abs(x) < 10 else f"{x:.1f}") for x in shown[col]]
    counts = table["status"].value_counts(sort=False)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    return f"{len(table)} published numbers: {summary}.\n\n" + markdown_table(shown)


def mark_user_activations(table: pd.DataFrame, user_models) -> pd.DataFrame:
    """Mark every compared row of a model analysed from user activations as not comparable.

    A name under config ``activations:`` may be a published model id (a user's own capture
    of DeiT-Tiny, say); its numbers come from the user's files and sample, never from the
    paper's setting, so each of its rows that ran gets status ``not comparable`` and
    :data:`USER_ACTIVATIONS_REASON`. Rows of other models, and rows not run, are unchanged;
    the order of :func:`comparison_table` is kept (:data:`STATUS_ORDER`, stable).
    """
    names = set(user_models or ())
    if not names or not len(table):
        return table
    ran = ~table["status"].isin([NOT_RUN, NOT_PUBLISHED])
    hit = (table["model_id"].isin(names) & ran).to_numpy()
    if not hit.any():
        return table
    out = table.copy()
    out.loc[hit, "status"] = NOT_COMPARABLE
    out.loc[hit, "reason"] = USER_ACTIVATIONS_REASON
    order = np.argsort(out["status"].map(STATUS_ORDER).to_numpy(), kind="stable")
    return out.iloc[order].reset_index(drop=True)
