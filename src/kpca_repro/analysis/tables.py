"""The paper's tables: their registry (:data:`TABLES`, one :class:`Table` per table) and the
builders that aggregate per-head and eigenvalue records into them (:func:`paper_table`,
:func:`table_corrected`, :func:`table_spectra`).

Adding a table is one entry of :data:`TABLES` and, for a per-head table, one row function here
(docs/internals.md, "Tables" and "Recipes"). The rest of the stage, one concern a module:
:mod:`kpca_repro.analysis.statistics` (exact statistics over heads and images),
:mod:`kpca_repro.analysis.intervals` (solver and bootstrap intervals) and
:mod:`kpca_repro.analysis.rendering` (model names, row labels, Markdown).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kpca_repro.analysis.columns import Column, statistic_columns
from kpca_repro.analysis.intervals import (
    UNCERTAINTY_DEFAULTS,
    deciding_head,
    similarity_intervals,
    spectrum_intervals,
    with_intervals,
)
from kpca_repro.analysis.rendering import display_name
from kpca_repro.analysis.statistics import (
    SPECTRUM_STATS,
    eigenvalue_array,
    exact_mean,
    exact_std,
    over_heads,
    spectrum_statistics,
)

__all__ = [
    "Table",
    "TABLES",
    "TABLE1_STATISTICS",
    "TABLE4_STATISTICS",
    "decoder_row",
    "decoders_prefix_table",
    "CORRECTED_METRICS",
    "CKA_COLUMNS",
    "all_directions_kept",
    "TEXT_CORRECTED_METRICS",
    "read_head_records",
    "paper_table",
    "table1_row",
    "table4_row",
    "table_corrected",
    "table_spectra",
    "column_schema",
]

#: What the corrected variant adds beyond the paper's metrics (docs/method.md 17): CKA with the
#: unbiased HSIC estimator and the projection test of the claim itself, each a mean over heads.
EXTENSION_METRICS = (
    ("linear_cka_unbiased", "linear CKA, unbiased HSIC", "mean"),
    ("rbf_cka_unbiased", "RBF CKA, unbiased HSIC", "mean"),
    ("projection_cos", "projection test: cos(h^, h) (the claim itself)", "mean"),
    ("projection_rel_error", "projection test: ||H^ - H|| / ||H||", "mean"),
    ("projection_norm_ratio", "projection test: ||H^|| / ||H||", "mean"),
)

#: Corrected-variant metrics: (per-head column, label, the paper's statistic over heads).
CORRECTED_METRICS = (
    ("direct_cos_mean", "direct cosine (token rows)", "max"),
    ("optimal_cos_mean", "optimal-matching cosine (token rows)", "max"),
    ("direct_abs_cos_columns", "direct |cosine| (columns)", "max"),
    ("optimal_abs_cos_columns", "optimal-matching |cosine| (columns)", "max"),
    ("linear_cka", "linear CKA", "mean"),
    ("rbf_cka", "RBF CKA", "mean"),
    *EXTENSION_METRICS,
)

#: The CKA columns, whose statistics leave out the heads where every direction is kept (docs/method.md 17.1).
CKA_COLUMNS = ("linear_cka", "rbf_cka", "linear_cka_unbiased", "rbf_cka_unbiased")


#: Table 4's corrected metrics: the paper's statistic is the mean over heads (docs/method.md 3),
#: of per-head token maxima for the cosines (MDC, MOC) and of the token means beside them.
TEXT_CORRECTED_METRICS = (
    ("direct_cos_max", "MDC: max direct cosine over tokens", "mean"),
    ("optimal_cos_max", "MOC: max optimal-matching cosine over tokens", "mean"),
    ("direct_cos_mean", "direct cosine (token rows)", "mean"),
    ("optimal_cos_mean", "optimal-matching cosine (token rows)", "mean"),
    ("direct_abs_cos_columns", "direct |cosine| (columns)", "mean"),
    ("optimal_abs_cos_columns", "optimal-matching |cosine| (columns)", "mean"),
    ("linear_cka", "linear CKA", "mean"),
    ("rbf_cka", "RBF CKA", "mean"),
    *EXTENSION_METRICS,
)


def read_head_records(
    head_files: list[str], meta_files: list[str], count_key: str
) -> tuple[pd.DataFrame, dict[str, dict]]:
    """Concatenate the per-head records of all shards and sum their metadata per model.

    Args:
        head_files: per-head CSVs (``results/heads/<variant>/<model>/...csv``), in table order.
        meta_files: the JSON metadata beside them.
        count_key: the metadata count summed over shards (``"n_images"`` or ``"n_sentences"``).

    Returns:
        ``(records, meta)``: the records in file order; ``meta[model_id]`` the first shard's
        metadata (``weights_sha256``, ``longformer_transposed``, ...) with ``count_key`` summed.
    """
    import json

    heads = pd.concat([pd.read_csv(f) for f in head_files], ignore_index=True)
    meta: dict[str, dict] = {}
    for f in meta_files:
        with open(f) as fh:
            m = json.load(fh)
        meta.setdefault(m["model_id"], {**m, count_key: 0})[count_key] += m[count_key]
    return heads, meta


def _head_order(df: pd.DataFrame) -> pd.DataFrame:
    """One model's records in canonical (layer, input, head) order, however they were sharded.

    Statistics are order-independent by themselves (:func:`~kpca_repro.analysis.statistics.exact_mean`); the order makes
    the selected rows and any further per-row output reproducible.
    """
    keys = [c for c in ("layer", "sample_rank", "head") if c in df.columns]
    return df.sort_values(keys, kind="stable") if keys else df


#: (table column, per-head column, statistic over heads) of Table 1 (docs/method.md 2): its
#: registry entry's ``statistics`` (:data:`TABLES`).
TABLE1_STATISTICS = (
    ("MDC", "direct_cos_mean", "max"),
    ("MOC", "optimal_cos_mean", "max"),
    ("LCKA", "linear_cka", "mean"),
    ("KCKA", "rbf_cka", "mean"),
)
#: The same for Table 4 (docs/method.md 3): NaN-skipping means over heads.
TABLE4_STATISTICS = (
    ("MDC", "direct_cos_max", "nanmean"),
    ("MOC", "optimal_cos_max", "nanmean"),
    ("LCKA", "linear_cka", "nanmean"),
    ("KCKA", "rbf_cka", "nanmean"),
)


def paper_table(
    table: Table,
    heads: pd.DataFrame,
    meta: dict[str, dict],
    draws: dict[str, np.ndarray] | None = None,
    uncertainty: dict | None = None,
) -> pd.DataFrame:
    """A per-head table of the paper variant: the reference's aggregation, one row per model.

    Per model, its heads in :func:`_head_order`: ``model``, the id column, each statistic of
    ``table.statistics`` over the heads the table aggregates (``table.drops``: those not flagged
    ``dropped``, as Table 1's reference drops them; else all, Table 4's reference keeps them and
    its ``nanmean`` skips their NaN; ``max`` skips NaN, ``mean`` propagates it, as ``np.mean``),
    then ``table.row(heads, kept, meta)``.

    Args:
        table: a per-head entry of :data:`TABLES`.
        heads: per-head records of the paper variant with a ``model`` column.
        meta: model id -> metadata (``weights_sha256``, the count ``table.count_key``, ...).
        draws: per-head solver draws (signs and rotations), rows as ``heads``
            (:func:`kpca_repro.method.uncertainty.read_sign_draws`).
        uncertainty: with it (``seed``, ``bootstrap``, ``coverage``, ``sign_coverage``), the
            interval columns of :func:`~kpca_repro.analysis.intervals.similarity_intervals` (over the aggregated heads)
            after the last statistic and the settings at the end; without it, no interval columns.

    Returns:
        One row per model, in the order of first appearance in ``heads``.

    Raises:
        KeyError: a per-head column of ``table.statistics``, or a model's metadata, is missing.
    """
    rows = []
    for model, df in heads.groupby("model", sort=False):
        df = _head_order(df)
        kept = df[~df["dropped"].astype(bool)] if table.drops else df
        row = {
            "model": display_name(model),
            table.id_column: model,
            **{name: over_heads(kept[col], how) for name, col, how in table.statistics},
            **table.row(df, kept, meta[model]),
        }
        if uncertainty is not None:
            row = with_intervals(
                row,
                similarity_intervals(kept, table.statistics, draws, uncertainty, table.name, model),
                uncertainty,
                draws,
                table.statistics,
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _n_nonfinite(heads: pd.DataFrame, statistics: tuple) -> int:
    """Heads with a non-finite value in a per-head column of ``statistics``."""
    return int((~np.isfinite(heads[[col for _, col, _ in statistics]].to_numpy(float))).any(axis=1).sum())


def _head_counts(heads: pd.DataFrame, kept: pd.DataFrame, statistics: tuple) -> dict[str, int]:
    """``n_heads_nonfinite`` (of Tables 1 and 4 alike): the aggregated heads with a non-finite value in
    a per-head column of ``statistics``, which the reference's mean propagates (Table 1) or skips
    (Table 4); then the flag counts over all heads (``exp`` overflow, g_i g_j overflow, allclose)."""
    return {
        "n_heads_nonfinite": _n_nonfinite(kept, statistics),
        "n_exp_overflow": int(heads["exp_overflow"].astype(bool).sum()),
        "n_outer_overflow": int(heads["outer_overflow"].astype(bool).sum()),
        "n_allclose": int(heads["allclose"].astype(bool).sum()),
    }


def table1_row(heads: pd.DataFrame, kept: pd.DataFrame, meta: dict) -> dict:
    """Table 1's columns after MDC, MOC, LCKA, KCKA for one model (docs/method.md 2).

    The means over the kept heads of the two cosines, the head that decides MDC and its
    eigengap (docs/uncertainty.md), the image and head counts and the weights' SHA-256. Every
    head with a non-finite statistic is counted, in one of two disjoint columns:
    ``n_heads_dropped`` (a non-finite centered Gram matrix or V_KPCA: dropped, as the reference
    drops them) and ``n_heads_nonfinite`` (kept, yet a statistic is not finite, e.g. V_KPCA
    underflows to 0 and KCKA is NaN, docs/method.md 2 step 3: it poisons the mean).

    Args:
        heads: one model's per-head records (paper variant); ``kept``: those not ``dropped``.
        meta: the model's metadata (``n_images``, ``weights_sha256``).
    """
    return {
        "MDC_mean_over_heads": exact_mean(kept["direct_cos_mean"], skipna=True),
        "MOC_mean_over_heads": exact_mean(kept["optimal_cos_mean"], skipna=True),
        **deciding_head(kept, "direct_cos_mean"),
        "n_images": meta["n_images"],
        "n_heads": len(heads),
        "n_heads_analysed": len(kept),
        "n_heads_dropped": int(heads["dropped"].astype(bool).sum()),
        **_head_counts(heads, kept, TABLE1_STATISTICS),
        "weights_sha256": meta["weights_sha256"],
    }


def table4_row(heads: pd.DataFrame, kept: pd.DataFrame, meta: dict) -> dict:
    """Table 4's columns after MDC, MOC, LCKA, KCKA for one language model (docs/method.md 3).

    Table 4's MDC and MOC are means over heads of per-head token *maxima*; beside them Table 1's
    statistics of the same records (max over heads of the token means) and the head that decides
    them. The reference keeps every head (``kept`` is ``heads``): a head with a non-finite
    centered Gram matrix (flagged ``dropped``) has NaN statistics, skipped by the means, and a
    matched cosine of 0 (its NaN costs are set to 0); ``n_heads_nonfinite`` counts the heads with
    any non-finite statistic, so there is no ``n_heads_dropped``.

    Args:
        heads, kept: one model's per-head records (paper variant), all of them.
        meta: the model's metadata (``n_sentences``, ``weights_sha256``, ``longformer_transposed``).
    """
    return {
        "MDC_table1_statistic": heads["direct_cos_mean"].max(),
        "MOC_table1_statistic": heads["optimal_cos_mean"].max(),
        # MDC here is a mean over heads; the head behind Table 1's statistic (its maximum)
        **deciding_head(heads, "direct_cos_mean", "MDC_table1_statistic_"),
        "n_sentences": meta["n_sentences"],
        "n_heads": len(heads),
        **_head_counts(heads, kept, TABLE4_STATISTICS),
        "n_tokens": int(heads["n_tokens"].max()),
        "longformer_transposed": bool(meta.get("longformer_transposed", False)),
        "weights_sha256": meta["weights_sha256"],
    }


def decoder_row(heads: pd.DataFrame, kept: pd.DataFrame, meta: dict) -> dict:
    """The decoders table's columns after MDC, MOC, LCKA, KCKA for one decoder (docs/method.md 16).

    The full-prefix view: Table 4's statistics (means over heads of per-head token maxima, NaN
    skipped) of V against V_KPCA^(N) on each row's real tokens, then the projection test of the
    claim itself at each row's last real token (means over heads, docs/method.md 17.3) and the
    heads whose kept eigenvectors span the whole centered space (their CKA tests only g, 17.1).
    A head of the records is a KV head (k and v define V and V_KPCA): with grouped-query
    attention a layer has fewer of them than query heads, and both counts are given.

    Args:
        heads, kept: one decoder's per-head records (paper variant), all of them.
        meta: its metadata (``n_sentences``, ``n_heads``, ``n_kv_heads``, ``weights_sha256``).
    """
    return {
        **_projection_means(heads),
        "n_sentences": meta["n_sentences"],
        "n_heads": len(heads),
        "n_heads_all_directions_kept": int(all_directions_kept(heads).sum()),
        "n_query_heads": int(meta["n_query_heads"]),
        "n_kv_heads": int(meta["n_kv_heads"]),
        **_head_counts(heads, kept, TABLE4_STATISTICS),
        "n_tokens": int(heads["n_tokens"].max()),
        "weights_sha256": meta["weights_sha256"],
    }


def decoders_prefix_table(records: dict[tuple[str, str], pd.DataFrame], variant: str) -> pd.DataFrame:
    """The decoders' prefix profile (docs/method.md 16): Table 4's four metrics per prefix length.

    Args:
        records: ``(model id, prefix)`` -> that model's per-head records on each row's first
            ``prefix`` real tokens (``"16"``, ``"32"``, ...; ``"N"``: each row's full length, the
            decoders table's records), in the order of the rows of the result.
        variant: the records' variant (a column of the result).

    Returns:
        One row per (model, prefix): ``model, hf_id, variant, prefix, n_tokens`` (mean token
        count of a head: P, or the mean row length at N), ``n_rows`` (rows at least P tokens
        long), ``n_heads`` (KV heads of those rows over all layers), MDC, MOC, LCKA, KCKA as
        :data:`TABLE4_STATISTICS` (NaN-skipping means over heads) and ``n_heads_nonfinite``;
        ``cka_all_directions_kept`` (every head keeps every direction, ``P <= d + 1``: LCKA and
        KCKA test only ``g``, docs/method.md 17.1) and the count of such heads; the corrected
        variant's unbiased CKAs (``LCKA_unbiased``, ``KCKA_unbiased``); the projection test's
        means (``projection_*``, ``control_projection_norm_ratio``, 17.3).
    """
    rows = []
    unbiased = (("LCKA_unbiased", "linear_cka_unbiased"), ("KCKA_unbiased", "rbf_cka_unbiased"))
    for (model, prefix), df in records.items():
        # a P longer than every row: no records, NaN statistics
        df = df.reindex(columns=list(dict.fromkeys([*df.columns, *(col for _, col, _ in TABLE4_STATISTICS)])))
        rows.append(
            {
                "model": display_name(model),
                "hf_id": model,
                "variant": variant,
                "prefix": str(prefix),
                "n_tokens": exact_mean(df["n_tokens"]),
                "n_rows": int(df["sample_rank"].nunique()),
                "n_heads": len(df),
                **{name: over_heads(df[col], how) for name, col, how in TABLE4_STATISTICS},
                "n_heads_nonfinite": _n_nonfinite(df, TABLE4_STATISTICS),
                # every head of a P <= d + 1 keeps every direction: its CKA tests only g (docs/method.md 17.1)
                "cka_all_directions_kept": bool(len(df)) and bool(all_directions_kept(df).all()),
                "n_heads_all_directions_kept": int(all_directions_kept(df).sum()) if len(df) else 0,
                **{name: over_heads(df[col], "nanmean") for name, col in unbiased if col in df},
                **_projection_means(df),
            }
        )
    return pd.DataFrame(rows)


def all_directions_kept(df: pd.DataFrame) -> pd.Series:
    """Per head (bool Series on ``df``'s index), whether its kept eigenvectors span the whole
    centered space (docs/method.md 17.1); from ``n_tokens`` and ``head_dim`` where the records
    predate the column."""
    if "all_directions_kept" in df:
        return df["all_directions_kept"].astype(bool)
    if (
        "n_tokens" not in df or "head_dim" not in df
    ):  # records without their sizes: nothing is known to be in the regime
        return pd.Series(False, index=df.index)
    return pd.Series(np.minimum(df["head_dim"], df["n_tokens"]) >= df["n_tokens"] - 1, index=df.index)


def _projection_means(heads: pd.DataFrame) -> dict:
    """The projection test's per-head columns (docs/method.md 17.3), each as a mean over heads (NaN skipped)."""
    names = ("projection_cos", "projection_rel_error", "projection_norm_ratio", "control_projection_norm_ratio")
    return {name: over_heads(heads[name], "nanmean") if name in heads else float("nan") for name in names}


def table_corrected(heads: pd.DataFrame, meta: dict[str, dict], table: Table) -> pd.DataFrame:
    """The corrected variant's table (docs/method.md Section 15), one row per (model, metric).

    For each (per-head column, label, paper statistic) of ``table.corrected``: the paper's
    statistic over heads (``paper_statistic``: max or mean) and its value, mean and standard
    deviation (ddof 1) over heads, the same three for the random Gaussian baseline and for the
    all-components control (``control_<column>``, docs/method.md 17), the number of heads and of
    non-finite heads (never dropped silently: a non-finite head is counted, and excluded from
    that metric's statistics), the count ``table.count_key`` and the weights. The statistics of
    the CKA columns (:data:`CKA_COLUMNS`) leave out the heads whose kept eigenvectors span the
    whole centered space (``all_directions_kept``: their CKA is the control's, docs/method.md
    17.1), counted in ``n_all_directions_kept``.
    """
    rows = []
    for model, df in heads.groupby("model", sort=False):
        df = _head_order(df)
        kept_all = all_directions_kept(df)
        for col, label, how in table.corrected:
            if col not in df:  # records without that metric (no projection test without q and h)
                continue
            cka = col in CKA_COLUMNS
            part = df[~kept_all] if cka else df  # the CKA of a head that keeps every direction tests only g
            vals = part[col]
            ok = vals[np.isfinite(vals)]
            base = part.get(f"baseline_{col}", pd.Series(dtype=float))
            base = base[np.isfinite(base)]
            control = part.get(f"control_{col}", pd.Series(dtype=float))
            control = control[np.isfinite(control)]
            rows.append(
                {
                    "model": display_name(model),
                    table.id_column: model,
                    "metric": label,
                    "column": col,
                    "paper_statistic": f"{how} over heads",
                    "paper_statistic_value": over_heads(ok, how),
                    "mean": exact_mean(ok),
                    "std": exact_std(ok, ddof=1),
                    "baseline_paper_statistic_value": over_heads(base, how) if len(base) else float("nan"),
                    "baseline_mean": exact_mean(base),
                    "baseline_std": exact_std(base, ddof=1),
                    "control_paper_statistic_value": over_heads(control, how) if len(control) else float("nan"),
                    "control_mean": exact_mean(control),
                    "control_std": exact_std(control, ddof=1),
                    "n_heads": len(df),
                    "n_nonfinite": int(len(vals) - len(ok)),
                    "n_all_directions_kept": int(kept_all.sum()) if cka else 0,
                    table.count_key: meta[model][table.count_key],
                    "weights_sha256": meta[model]["weights_sha256"],
                }
            )
    return pd.DataFrame(rows)


def table_spectra(records: dict[tuple[str, str], pd.DataFrame], uncertainty: dict | None = None) -> pd.DataFrame:
    """Table 2 (``keys == "standardized"``) or Table 3 rows from per-head eigenvalue records.

    Args:
        records: ``(model id, keys)`` -> records, ``keys`` in ``{"standardized", "raw"}``.

    Returns:
        One row per model. With both key treatments present (Table 3): the standardized
        statistics, the unstandardized ones (suffix ``_raw``) and the percentage change
        ``(raw / standardized - 1) * 100`` per statistic. With ``uncertainty`` (``seed``,
        ``bootstrap``, ``coverage``), then the bootstrap bounds of every mean and std cell
        (:func:`~kpca_repro.analysis.intervals.spectrum_intervals`): ``<cell>_lower``,
        ``<cell>_upper`` (``max_mean_lower``, ``max_mean_raw_lower``, ...).
    """
    models = list(dict.fromkeys(m for m, _ in records))
    rows = []
    for model in models:
        row: dict = {"model": display_name(model), "timm_id": model}
        std = (
            spectrum_statistics(eigenvalue_array(records[(model, "standardized")]))
            if (model, "standardized") in records
            else None
        )
        raw = spectrum_statistics(eigenvalue_array(records[(model, "raw")])) if (model, "raw") in records else None
        if std:
            row.update(std)
        if raw:
            row.update({f"{k}_raw": v for k, v in raw.items()})
        if std and raw:
            for name in SPECTRUM_STATS:
                row[f"{name}_change_pct"] = (raw[f"{name}_mean"] / std[f"{name}_mean"] - 1) * 100
        if uncertainty is not None:
            for keys, suffix in (("standardized", ""), ("raw", "_raw")):
                if (model, keys) in records:
                    bounds = spectrum_intervals(eigenvalue_array(records[(model, keys)]), uncertainty, model, keys)
                    row.update(
                        {
                            k.replace("_lower", f"{suffix}_lower").replace("_upper", f"{suffix}_upper"): v
                            for k, v in bounds.items()
                        }
                    )
            row["bootstrap_resamples"] = int({**UNCERTAINTY_DEFAULTS, **uncertainty}["bootstrap"])
            row["coverage"] = float({**UNCERTAINTY_DEFAULTS, **uncertainty}["coverage"])
        rows.append(row)
    return pd.DataFrame(rows)


def column_schema(table: Table, paper: bool) -> tuple[str, tuple[Column, ...]]:
    """What describes the columns of ``table``'s CSV (:mod:`kpca_repro.analysis.columns`).

    Args:
        table: an entry of :data:`TABLES`.
        paper: the variant builds the paper's tables (``Variant.tables == "paper"``).

    Returns:
        ``(schema, extra)`` for :func:`~kpca_repro.analysis.columns.describe`: an eigenvalue table
        ``"spectrum_table"``; a per-head table ``"per_head_table"`` with its statistics'
        entries (:func:`~kpca_repro.analysis.columns.statistic_columns`) in the paper variant,
        ``"corrected_table"`` otherwise.
    """
    if table.keys:
        return "spectrum_table", ()
    return ("per_head_table", statistic_columns(table.statistics)) if paper else ("corrected_table", ())


@dataclass(frozen=True)
class Table:
    """One table of the paper: what it reads, how each variant aggregates it, what it is compared with.

    The rule ``table`` (``{table}``: :data:`TABLES`' names) and its script, rule ``all``, the
    report (:mod:`kpca_repro.workflow.paths`) and the comparison with the published numbers
    (:mod:`kpca_repro.analysis.comparison`) read a table only from here (docs/internals.md, "Tables").

    Attributes:
        name: ``table<N>``: ``results/<name><suffix>.csv|.md`` per variant, the report page
            ``results/html/<name><suffix>.html``, "Table <N>" in the comparison.
        domain: ``"vision"`` (id column ``timm_id``, count ``n_images``), ``"text"`` or
            ``"decoders"`` (``hf_id``, ``n_sentences``): the models of ``<domain>.models`` and the
            ``activations:`` entries of that kind; built (rule ``all``) when there is one.
        row: per-head tables: one model's paper-variant columns after the statistics,
            ``row(heads, kept, meta) -> dict`` (:func:`paper_table`); None for eigenvalue tables.
        statistics: per-head tables: (column, per-head column, ``"max" | "mean" | "nanmean"``
            over heads), the published columns; compared with the corrected table's row of
            that per-head column.
        drops: the paper variant leaves out the heads flagged ``dropped`` (Table 1's reference).
        corrected: the corrected variant's (per-head column, label, statistic over heads) (:func:`table_corrected`).
        keys: eigenvalue tables: the key treatments (``standardized``, ``raw``) of :func:`table_spectra`.
        columns: eigenvalue tables: published column -> the column of both variants' tables.
        published: its CSV in ``comparison.published_tables`` (columns ``model``, the id column,
            the compared ones); None: not compared.
        caption: reST printed above the table on its report page, ``results/html/<name><suffix>.html``
            (:func:`kpca_repro.analysis.report.table_html`; a docutils warning stops the table's job).
        label: its title where the name is not ``table<N>`` (the decoders' table).

    Raises:
        ValueError: a name not ``table<N>`` (the rules' file names), an unknown domain, or
            neither a row function nor key treatments.
    """

    name: str
    domain: str
    row: Callable[[pd.DataFrame, pd.DataFrame, dict], dict] | None = None
    statistics: tuple[tuple[str, str, str], ...] = ()
    drops: bool = False
    corrected: tuple[tuple[str, str, str], ...] = ()
    keys: tuple[str, ...] = ()
    columns: dict[str, str] = field(default_factory=dict)
    published: str | None = None
    caption: str = ""
    label: str = ""

    def __post_init__(self):
        if (
            not re.fullmatch(r"table\w+", self.name)
            or self.domain not in ("vision", "text", "decoders")
            or not (self.row or self.keys)
        ):
            raise ValueError(
                f"table {self.name!r}: a name table<N>, the domain vision, text or decoders, and a row function or "
                "key treatments"
            )

    @property
    def title(self) -> str:
        return self.label or "Table " + self.name.removeprefix("table")

    @property
    def id_column(self) -> str:
        return "timm_id" if self.domain == "vision" else "hf_id"

    @property
    def count_key(self) -> str:
        return "n_images" if self.domain == "vision" else "n_sentences"

    @property
    def compared(self) -> dict[str, tuple[str, str]]:
        """Published column -> (column of the paper variant's table, of the corrected one)."""
        return {name: (name, col) for name, col, _ in self.statistics} or {c: (r, r) for c, r in self.columns.items()}


_SPECTRUM = [f"{s}_{m}" for s in SPECTRUM_STATS for m in ("mean", "std")]

#: Every table compared with the paper, by name (the ``{table}`` wildcard), in the paper's order.
TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            "table1",
            "vision",
            table1_row,
            TABLE1_STATISTICS,
            drops=True,
            corrected=CORRECTED_METRICS,
            published="table1_vision_similarity.csv",
            caption=r"""**Table 1: V against V_KPCA in vision transformers.** Claim tested: the value vectors V of
each head equal the KPCA coefficients V_KPCA = G A − G 1_N A (Teo & Nguyen, Eq. 5), with A the
top-d eigenvectors of the centered Gram matrix of the keys.

How it was computed: for every (image, layer, head), the Gram matrix of the keys
exp(kᵢᵀkⱼ/√d), normalised by gᵢgⱼ, centered, ``eigh``; V_KPCA from the top-d eigenvectors;
then the token-row direct cosine (MDC = max over heads of the per-head mean), the optimal
token matching by the Hungarian algorithm (MOC = max over heads of the per-head mean
matched cosine), linear CKA and RBF CKA (means over heads). ``n_allclose`` counts heads
where ``torch.allclose(V, V_KPCA)`` holds. In the paper variant, ``MDC_solver_lower`` /
``MDC_solver_upper`` (and MOC's) bound what the eigensolver's freedom can print, and
``*_lower`` / ``*_upper`` are the bootstrap over images (combined with that solver variation
for MDC and MOC). *Model of variation:* an eigensolver in float32 returns the exact
eigenvectors of a matrix within about n·u·‖K‖ of the true one (u = 2⁻²⁴, n the number of
tokens), so any eigenvector's sign, and any rotation among eigenvectors whose eigenvalues lie
closer than that tolerance (a near-degenerate group, also across the top-d boundary), are
equally correct answers; MDC's solver interval takes the exact extremes over those rotations
(for the solver's own signs, and for random signs at the central 99 % of draws), MOC's
interval is the central 99 % of draws with random signs and Haar-random rotations inside the
groups, joined with the reproduced value; LCKA and KCKA vary the sample only. """
            r"""``MDC_layer``, ``MDC_head``, ``MDC_sample_rank``
and ``MDC_eigengap`` name the head that decides MDC and its smallest relative eigengap: a
maximum over thousands of heads is decided by one head, so one head's near-degenerate
eigenpair can move the whole statistic. ``interval_note`` says why a value lies outside its
own interval, if one does; docs/uncertainty.md.

The **paper** variant is the authors' float32 code (\|λ\|-descending eigenpairs, overflowing
heads dropped). The **corrected** variant (float64, log-domain Gram, deterministic signs)
reports each metric as mean ± std over heads beside the same statistic for a random
Gaussian V_KPCA, adds the column-wise comparison the paper's text describes, and counts
non-finite heads.""",
        ),
        Table(
            "table2",
            "vision",
            keys=("standardized",),
            columns={c: c for c in _SPECTRUM},
            published="table2_eigenvalues_standardized.csv",
            caption=r"""**Table 2: eigenvalues of the centered Gram matrix (× 10⁻⁶), standardized keys.** Claim
tested: the KPCA eigenvalues that would make V = V_KPCA are of order 10², as Teo & Nguyen's
derivation needs.

How it was computed: per (image, layer, head), keys standardized per token over their d
features (unbiased std, as the authors' code does), Gram matrix, centering, the 64 largest
eigenvalues (no division by N). Per image: the rank-wise mean over layers × heads, then its
max, min, mean and lower median; the table gives mean ± std over the images, and
``<cell>_lower`` / ``<cell>_upper`` a percentile bootstrap over the images of each cell.
The **paper** variant is float32 with plain ``exp``; the **corrected** variant uses float64
and a log-domain Gram matrix (identical where nothing overflows).""",
        ),
        Table(
            "table3",
            "vision",
            keys=("standardized", "raw"),
            columns={c: f"{c}_raw" for c in _SPECTRUM},
            published="table3_eigenvalues_unstandardized.csv",
            caption=r"""**Table 3: eigenvalues with and without key standardization (× 10⁻⁶).** Same computation
as Table 2 with the raw keys (the paper's starred rows) beside the standardized ones, and the
percentage change. In the **paper** variant, heads whose ``exp`` overflows in float32 give
non-finite statistics (counted in ``n_nonfinite_heads_raw``); the **corrected** variant's
log-domain Gram matrix is finite for every key magnitude.""",
        ),
        Table(
            "table4",
            "text",
            table4_row,
            TABLE4_STATISTICS,
            corrected=TEXT_CORRECTED_METRICS,
            published="table4_nlp_similarity.csv",
            caption=r"""**Table 4: V against V_KPCA in encoder language models.** Same claim as Table 1, for
Hugging Face encoders on sampled WikiText-103 test rows (padded to the longest row,
truncated at 128 tokens).

The **paper** variant is the authors' NLP script: padding positions included, top-d
eigenvectors in ascending order, MDC and MOC the mean over heads of the per-head *maxima*
over tokens (a different statistic from Table 1's), NaN heads skipped per column, and
Longformer read with its (sequence, batch) transposition. The **corrected** variant
excludes padding per sequence, reads Longformer batch-first, uses each model's own head
dimension, and reports every metric next to a random Gaussian baseline.""",
        ),
        Table(
            "table_decoders",
            "decoders",
            decoder_row,
            TABLE4_STATISTICS,
            corrected=TEXT_CORRECTED_METRICS,
            label="Decoders",
            caption=r"""**Decoders: V against V_KPCA in causal heads (the full-prefix view).** Not in the paper:
the same claim for decoder language models (docs/method.md 16). In a causal head query i
attends to the keys of its prefix k₁..kᵢ, so its kernel PCA is that prefix's; the last
query's is the whole row's. This table compares V with V_KPCA of each row's real tokens
(padding left out, on whichever side the tokenizer pads), with Table 4's four metrics:
MDC and MOC the mean over heads of the per-head maxima over tokens, LCKA and KCKA means over
heads. A head here is a KV head: with grouped-query attention (``n_kv_heads`` <
``n_query_heads``) k and v, hence V and V_KPCA, belong to the KV head that several query heads
share. ``results/decoders_prefix.csv`` gives the same metrics on each row's first P tokens.""",
        ),
    )
}
