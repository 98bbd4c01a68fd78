"""How the tables read: the models' short names, the labels of stand-in and user rows, and
the Markdown of every table (``results/<table><suffix>.md``, the comparison).

No registry and no statistics here: the functions take the frames the table builders of
:mod:`kpca_repro.analysis.tables` return, and a table's entry only for its column names.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import pandas as pd

__all__ = [
    "MODEL_NAMES",
    "display_name",
    "STAND_IN_LABEL",
    "USER_LABEL",
    "label_rows",
    "markdown_table",
    "paper_markdown",
    "PAPER_INTERVAL_NOTE",
    "paper_cells",
    "corrected_markdown",
]


#: Short names of the pretrained models (timm and Hugging Face ids) in the paper's tables.
#: (:data:`kpca_repro.training.figures.TRAINING_MODEL_NAMES` names the architectures trained for Figures 1 and 4.)
MODEL_NAMES = {
    "vit_tiny_patch16_224": "ViT-Tiny",
    "vit_small_patch16_224": "ViT-Small",
    "vit_base_patch16_224": "ViT-Base",
    "vit_large_patch16_224": "ViT-Large",
    "deit_tiny_patch16_224": "DeiT-Tiny",
    "deit_small_patch16_224": "DeiT-Small",
    "deit_base_patch16_224": "DeiT-Base",
    "deit_tiny_distilled_patch16_224": "DeiT-Tiny-D",
    "deit_small_distilled_patch16_224": "DeiT-Small-D",
    "deit_base_distilled_patch16_224": "DeiT-Base-D",
    "bert-base-uncased": "BERT-Base",
    "roberta-base": "RoBERTa-Base",
    "google/electra-base-discriminator": "ELECTRA-Base",
    "google/electra-small-discriminator": "ELECTRA-Small",
    "xlm-roberta-base": "XLM-RoBERTa",
    "allenai/longformer-base-4096": "Longformer",
    "sentence-transformers/all-MiniLM-L6-v2": "MiniLM",
    "camembert-base": "CamemBERT",
    "studio-ousia/luke-base": "LUKE",
}


#: Appended to the ``model`` cell of a row whose weights are stand-ins (config
#: ``comparison.stand_in_models``): random weights of the exact architecture (docs/hub_fixture.md),
#: an untrained network that must never be read as the paper's model.
STAND_IN_LABEL = " (stand-in weights)"
#: Appended to the ``model`` cell of a row built from a user's own activation files (docs/activations.md).
USER_LABEL = " (user activations)"


def label_rows(table: pd.DataFrame, ids, label: str) -> pd.DataFrame:
    """Append ``label`` to the ``model`` cell of the rows whose ``timm_id`` or ``hf_id`` is in ``ids``.

    Args:
        table: any results table with a ``model`` column and a ``timm_id`` or ``hf_id`` column.
        ids: model ids (as ``vision.models`` / ``text.models`` or ``activations:`` name them).
        label: :data:`STAND_IN_LABEL` or :data:`USER_LABEL`.

    Returns:
        A copy of ``table``, or ``table`` itself (the same CSV bytes) when no row matches.
    """
    ids = set(ids or ())
    id_column = next((c for c in ("timm_id", "hf_id") if c in table.columns), None)
    if not ids or id_column is None or "model" not in table.columns:
        return table
    hit = table[id_column].isin(ids).to_numpy()
    if not hit.any():
        return table
    out = table.copy()
    out.loc[hit, "model"] = out.loc[hit, "model"].astype(str) + label
    return out


def display_name(model_id: str) -> str:
    """The paper's short name of a model id, or the id itself."""
    return MODEL_NAMES.get(model_id, model_id)


class _PerHeadTable(Protocol):
    """What :func:`paper_markdown` reads of a per-head entry of :data:`kpca_repro.analysis.tables.TABLES`
    (a structural type: rendering stays below the registry, which names its models with :func:`display_name`)."""

    statistics: tuple[tuple[str, str, str], ...]

    @property
    def id_column(self) -> str: ...


def _escape_pipes(value):
    return value.replace("|", r"\|") if isinstance(value, str) else value


def markdown_table(frame: pd.DataFrame, **kwargs) -> str:
    """``frame.to_markdown(index=False, **kwargs)`` with ``|`` escaped as ``\\|`` in headers and cells.

    A literal ``|`` (``direct |cosine| (columns)``) would otherwise end a Markdown table cell
    and shift every column after it. Ends with a newline.
    """
    escaped = frame.rename(columns=_escape_pipes)
    for col in escaped.columns:
        if not pd.api.types.is_numeric_dtype(escaped[col]):
            escaped[col] = escaped[col].map(_escape_pipes)
    return escaped.to_markdown(index=False, **kwargs) + "\n"


def paper_markdown(frame: pd.DataFrame, table: _PerHeadTable) -> str:
    """Markdown of a per-head table, paper variant: the id columns and each statistic (the paper's
    MDC, MOC, LCKA, KCKA of Tables 1 and 4) as ``value [lower, upper]``.

    The interval is the combined one for MDC and MOC (sampling and solver variation) and the
    bootstrap for LCKA and KCKA (docs/uncertainty.md, section 3); a cell without an interval
    shows the value alone. Every other column (solver intervals, deciding head, counts,
    settings) stays in the CSV. Ends with a note on what the intervals are.

    Args:
        frame: the table of :func:`kpca_repro.analysis.tables.paper_table`, with or without
            its interval columns (``<statistic>_lower``, ``<statistic>_upper``).
        table: its entry of :data:`kpca_repro.analysis.tables.TABLES` (``statistics``, ``id_column``).
    """
    note = f"\n{PAPER_INTERVAL_NOTE}; the CSV beside this file has every other column.\n"
    return markdown_table(paper_cells(frame, table)) + note


#: What the brackets of :func:`paper_cells` are (the Markdown's note, the report's page).
PAPER_INTERVAL_NOTE = (
    "In brackets: for MDC and MOC the interval of sampling and solver variation together, for LCKA and KCKA the "
    "bootstrap over the inputs (docs/uncertainty.md)"
)


def paper_cells(frame: pd.DataFrame, table: _PerHeadTable) -> pd.DataFrame:
    """The cells of :func:`paper_markdown` (also the head of the report's page of the table): the id
    columns and each statistic as the text ``value [lower, upper]`` to three decimals
    (``0.124 [0.061, 0.181]``), the value alone without a finite interval, ``NaN`` without a value.

    Args:
        frame, table: as :func:`paper_markdown`.

    Returns:
        One row per row of ``frame``; columns ``model``, ``table.id_column``, then the statistics; str cells.
    """
    names = [name for name, _, _ in table.statistics]
    rows = []
    for _, r in frame.iterrows():
        cells = {"model": r["model"], table.id_column: r[table.id_column]}
        for name in names:
            lo, hi = r.get(f"{name}_lower"), r.get(f"{name}_upper")
            interval = (
                f" [{lo:.3f}, {hi:.3f}]"
                if lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi)
                else ""
            )
            cells[name] = f"{r[name]:.3f}{interval}" if np.isfinite(r[name]) else "NaN"
        rows.append(cells)
    return pd.DataFrame(rows, columns=["model", table.id_column, *names])


def corrected_markdown(table: pd.DataFrame, metrics: tuple) -> str:
    """Markdown of a corrected table: one row per model, one column per metric,
    ``mean ± std (random: mean, all components: mean)`` (the all-components control where the metric has one,
    docs/method.md 17).

    Args:
        table: the long table of :func:`kpca_repro.analysis.tables.table_corrected` (one row per
            model and metric: ``model``, ``metric``, ``mean``, ``std``, ``baseline_mean``, ``n_heads``,
            ``n_nonfinite``).
        metrics: the entry's ``corrected`` (per-head column, label, statistic) triples, e.g.
            :data:`kpca_repro.analysis.tables.CORRECTED_METRICS`: the columns, in their order
            (labels absent from ``table`` are left out), then ``heads (non-finite)``.
    """
    control = table["control_mean"] if "control_mean" in table else pd.Series(np.nan, index=table.index)
    cells = table.assign(
        cell=[
            f"{m:.3f} ± {s:.3f} (random {b:.3f}" + (f", all components {c:.3f})" if np.isfinite(c) else ")")
            for m, s, b, c in zip(table["mean"], table["std"], table["baseline_mean"], control)
        ]
    )
    wide = cells.pivot(index="model", columns="metric", values="cell")
    order = list(dict.fromkeys(table["model"]))
    wide = wide.loc[order, [label for _, label, _ in metrics if label in wide.columns]]
    counts = table.groupby("model", sort=False)[["n_heads", "n_nonfinite"]].max()
    wide["heads (non-finite)"] = [f"{counts.loc[m, 'n_heads']} ({counts.loc[m, 'n_nonfinite']})" for m in wide.index]
    return markdown_table(wide.reset_index())
