"""The paper's tables: their registry (:data:`TABLES`), the aggregation of per-head and
eigenvalue records into them, their intervals and their Markdown rendering."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from kpca_repro.method import uncertainty as unc

__all__ = [
    "STAND_IN_LABEL",
    "USER_LABEL",
    "label_rows",
    "read_head_records",
    "exact_mean",
    "exact_std",
    "MODEL_NAMES",
    "display_name",
    "Table",
    "TABLES",
    "paper_table",
    "table1_row",
    "table4_row",
    "TEXT_CORRECTED_METRICS",
    "table_corrected",
    "corrected_markdown",
    "paper_markdown",
    "markdown_table",
    "CORRECTED_METRICS",
    "spectrum_statistics",
    "eigenvalue_array",
    "table_spectra",
    "UNCERTAINTY_DEFAULTS",
    "similarity_intervals",
    "combine_for_maximum",
    "spectrum_intervals",
]

#: Uncertainty settings (config key ``uncertainty`` plus ``seed``; docs/uncertainty.md).
UNCERTAINTY_DEFAULTS = {"seed": 0, "bootstrap": 1000, "coverage": 0.95, "sign_coverage": 0.999}

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

#: Corrected-variant metrics: (per-head column, label, the paper's statistic over heads).
CORRECTED_METRICS = (
    ("direct_cos_mean", "direct cosine (token rows)", "max"),
    ("optimal_cos_mean", "optimal-matching cosine (token rows)", "max"),
    ("direct_abs_cos_columns", "direct |cosine| (columns)", "max"),
    ("optimal_abs_cos_columns", "optimal-matching |cosine| (columns)", "max"),
    ("linear_cka", "linear CKA", "mean"),
    ("rbf_cka", "RBF CKA", "mean"),
)


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
)


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


def read_head_records(head_files: list[str], meta_files: list[str], count_key: str) -> tuple[pd.DataFrame, dict[str, dict]]:
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

    Statistics are order-independent by themselves (:func:`exact_mean`); the order makes the
    selected rows and any further per-row output reproducible.
    """
    keys = [c for c in ("layer", "sample_rank", "head") if c in df.columns]
    return df.sort_values(keys, kind="stable") if keys else df


def exact_mean(values, skipna: bool = False) -> float:
    """Mean of float values that does not depend on their order.

    ``math.fsum`` (the correctly rounded sum of the exact values) divided by the count, so
    the records of a model give the same bits however shards, chunks or worker threads
    ordered them (a floating-point sum in another order can differ in the last digits).

    Args:
        values: 1-d array-like of floats.
        skipna: leave NaN out (pandas' ``mean``) or let it propagate (``np.mean``).

    Returns:
        The mean; NaN for no value (or a NaN with ``skipna=False``); ``±inf``/NaN as
        ``np.mean`` gives them when an infinite value is present.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if skipna:
        x = x[~np.isnan(x)]
    if x.size == 0:
        return float("nan")
    if not np.isfinite(x).all():  # NaN or inf: the result is that, whatever the order
        return float(np.mean(x))
    return math.fsum(x.tolist()) / x.size


def exact_std(values, ddof: int = 1) -> float:
    """Standard deviation (``ddof`` as in numpy) from :func:`exact_mean`'s order-independent sums.

    Args:
        values: 1-d array-like of finite floats.
        ddof: delta degrees of freedom (1: the unbiased estimate of pandas' ``std``).

    Returns:
        The standard deviation, NaN for at most ``ddof`` values.
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    if x.size <= ddof:
        return float("nan")
    m = exact_mean(x)
    return math.sqrt(math.fsum(((x - m) ** 2).tolist()) / (x.size - ddof))


#: (table column, per-head column, statistic over heads) of Table 1 (docs/method.md 2): its
#: registry entry's ``statistics`` (:data:`TABLES`).
TABLE1_STATISTICS = (("MDC", "direct_cos_mean", "max"), ("MOC", "optimal_cos_mean", "max"), ("LCKA", "linear_cka", "mean"), ("KCKA", "rbf_cka", "mean"))
#: The same for Table 4 (docs/method.md 3): NaN-skipping means over heads.
TABLE4_STATISTICS = (("MDC", "direct_cos_max", "nanmean"), ("MOC", "optimal_cos_max", "nanmean"), ("LCKA", "linear_cka", "nanmean"), ("KCKA", "rbf_cka", "nanmean"))
#: Statistics that depend on the eigenvector basis a solver returns (they get a solver interval).
SIGN_DEPENDENT = ("MDC", "MOC")


def _replicate_pair(lo: np.ndarray, hi: np.ndarray, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """One stored draw per head and replicate, the same pick for the lower and the upper array: ``(n, H)`` each."""
    h, r = lo.shape
    pick = rng.integers(0, r, size=(n, h))
    rows = np.arange(h)[None, :]
    return np.asarray(lo)[rows, pick].astype(np.float64), np.asarray(hi)[rows, pick].astype(np.float64)


def combine_for_maximum(value: float, solver: tuple[float, float], bootstrap: tuple[float, float]) -> tuple[float, float]:
    """The combined interval of a maximum over heads: the solver interval widened by the bootstrap's deviations.

    ``[s_lo - max(v - b_lo, 0), s_hi + max(b_hi - v, 0)]`` for the reproduced value ``v``, the
    solver interval ``[s_lo, s_hi]`` (it holds ``v``) and the percentile-bootstrap interval
    ``[b_lo, b_hi]`` of the solver's own configuration. Sampling and the solver each move the
    maximum by up to their own deviation; the interval adds the two (their worst alignment),
    so it holds both intervals, the solver interval in particular. A percentile bootstrap of
    a maximum runs low on its own (a resample of ``n`` images holds about ``0.63 n`` distinct
    ones, and its maximum is never above the full sample's: ``b_hi <= v``), which is why the
    solver interval's upper end is kept whole (docs/uncertainty.md, section 3).

    Returns:
        ``(lower, upper)``; NaN where an input is NaN.
    """
    (s_lo, s_hi), (b_lo, b_hi) = solver, bootstrap
    return float(s_lo - max(value - b_lo, 0.0)), float(s_hi + max(b_hi - value, 0.0))


def similarity_intervals(df: pd.DataFrame, statistics: tuple, draws: dict[str, np.ndarray] | None, settings: dict, tag: str, model: str) -> dict[str, float]:
    """Solver and bootstrap intervals of one row of Table 1 or Table 4 (docs/uncertainty.md).

    Resampling units are the images (``sample_rank``; sentences for Table 4). For each
    statistic ``S`` of ``statistics``:

    * ``S_solver_lower``, ``S_solver_upper`` (MDC, MOC): what the solver's freedom can print,
      all images, no resampling. The admissible eigenbases are every eigenvector's sign and
      any rotation inside each near-degenerate group (:mod:`kpca_repro.method.solver_variation`).
      Table 1's MDC with stored rotation bounds: the union of (a) the central
      ``sign_coverage`` range of the table statistic when every head takes a random sign
      draw and its *exact* lower / upper bound over the rotations (lower quantile of the
      lower envelope, upper quantile of the upper envelope) and (b) the exact range over
      rotations at the solver's own signs, which contains the reproduced value. Otherwise
      (Table 4's MDC, every MOC): the central ``sign_coverage`` range when every head takes
      one of its stored sign-and-rotation draws, independently (another solver changes the
      configuration of nearly every head at once), joined with the reproduced value (the
      solver's own configuration). A NaN draw is one the ``kpca_heads`` job proved to be
      below every replicate maximum (Table 1's MOC): skipped by the maximum, it changes
      nothing (:class:`kpca_repro.method.solver_variation.RunningFloor`).
    * ``S_lower``, ``S_upper``: the combined interval. A maximum over heads (Table 1):
      :func:`combine_for_maximum` of the solver interval and the central ``coverage``
      percentile bootstrap of the solver's own configuration. A mean over heads (Table 4):
      the percentile bootstrap in which every replicate also takes one solver draw per
      head, joined with the bootstrap of the solver's own configuration. Without stored
      draws (``draws`` None or zero-width) MDC and MOC get the bootstrap of the observed
      values and NaN solver bounds.

    Args:
        df: the heads the table aggregates (rows in :func:`_head_order`), whose index labels
            are the rows of ``draws``.
        statistics: (table column, per-head column, ``"max" | "mean" | "nanmean"``) triples.
        draws: per-head solver draws (:func:`kpca_repro.method.uncertainty.read_sign_draws`).
        settings: ``seed``, ``bootstrap``, ``coverage``, ``sign_coverage``.
        tag, model: with ``seed``, the bootstrap generator's seed (independent of sharding:
            the heads are in a canonical order and the images coded in sorted order).

    Returns:
        Column name -> bound.
    """
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    rng = np.random.default_rng(unc.stable_seed(cfg["seed"], tag, model))
    codes, n_groups = unc.group_codes(df["sample_rank"].to_numpy())
    idx = unc.bootstrap_indices(rng, n_groups, int(cfg["bootstrap"]))
    rows = df.index.to_numpy()
    out: dict[str, float] = {}
    sc, cov = cfg["sign_coverage"], cfg["coverage"]
    for name, col, how in statistics:
        stored = draws.get(col) if draws is not None and name in SIGN_DEPENDENT else None
        bounds = draws is not None and col == "direct_cos_mean" and all(k in draws and draws[k].shape[1] > 0 for k in unc.OPTIONAL_DRAW_NAMES)
        mean_vector = draws.get(unc.MEAN_VECTOR) if draws is not None and col == "direct_cos_mean" else None
        point = df[col].to_numpy(np.float64)[None, :]
        own = float(unc.replicate_statistics(point, codes, n_groups, how, None)[0])
        own_boot = unc.percentile_interval(unc.replicate_statistics(point, codes, n_groups, how, idx), cov)
        solver = None
        if bounds:
            own_lo = np.fmin(draws["direct_cos_mean_own_lower"][rows, 0].astype(np.float64), point[0])[None, :]
            own_hi = np.fmax(draws["direct_cos_mean_own_upper"][rows, 0].astype(np.float64), point[0])[None, :]
            lo_d, hi_d = draws["direct_cos_mean_lower"][rows], draws["direct_cos_mean_upper"][rows]
            lo, hi = _replicate_pair(lo_d, hi_d, rng, idx.shape[0])
            q_lo = unc.percentile_interval(unc.replicate_statistics(lo, codes, n_groups, how, None), sc)[0]
            q_hi = unc.percentile_interval(unc.replicate_statistics(hi, codes, n_groups, how, None), sc)[1]
            own_range = (unc.replicate_statistics(own_lo, codes, n_groups, how, None)[0], unc.replicate_statistics(own_hi, codes, n_groups, how, None)[0])
            solver = (float(min(q_lo, own_range[0])), float(max(q_hi, own_range[1])))
            joint = None
            if how != "max":
                lo, hi = _replicate_pair(lo_d, hi_d, rng, idx.shape[0])
                b_lo = unc.percentile_interval(unc.replicate_statistics(lo, codes, n_groups, how, idx), cov)[0]
                b_hi = unc.percentile_interval(unc.replicate_statistics(hi, codes, n_groups, how, idx), cov)[1]
                o_lo = unc.percentile_interval(unc.replicate_statistics(own_lo, codes, n_groups, how, idx), cov)[0]
                o_hi = unc.percentile_interval(unc.replicate_statistics(own_hi, codes, n_groups, how, idx), cov)[1]
                joint = (float(min(b_lo, o_lo)), float(max(b_hi, o_hi)))
        elif mean_vector is not None and len(mean_vector) and mean_vector.shape[1] > 0:
            # token mean of the direct cosine: m . sigma with fresh patterns (exact; sign-only files)
            m = mean_vector[rows]
            solver = unc.percentile_interval(unc.replicate_statistics(unc.fresh_direct_means(m, rng, idx.shape[0]), codes, n_groups, how, None), sc)
            joint = None if how == "max" else unc.percentile_interval(unc.replicate_statistics(unc.fresh_direct_means(m, rng, idx.shape[0]), codes, n_groups, how, idx), cov)
        elif stored is not None and stored.shape[1] > 0:
            # another solver changes the configuration of (nearly) every head at once: every head
            # takes a random stored draw, and the solver's own configuration (the reproduced
            # value) is one more admissible outcome, joined to the central range of the draws
            per_head = stored[rows]
            lo, hi = unc.percentile_interval(unc.replicate_statistics(unc.pick_draws(per_head, rng, idx.shape[0]), codes, n_groups, how, None), sc)
            solver = (float(np.fmin(lo, own)), float(np.fmax(hi, own)))
            joint = None
            if how != "max":
                b_lo, b_hi = unc.percentile_interval(unc.replicate_statistics(unc.pick_draws(per_head, rng, idx.shape[0]), codes, n_groups, how, idx), cov)
                joint = (float(np.fmin(b_lo, own_boot[0])), float(np.fmax(b_hi, own_boot[1])))
        if solver is None:
            if name in SIGN_DEPENDENT:
                out[f"{name}_solver_lower"] = out[f"{name}_solver_upper"] = float("nan")
            out[f"{name}_lower"], out[f"{name}_upper"] = own_boot
            continue
        out[f"{name}_solver_lower"], out[f"{name}_solver_upper"] = solver
        out[f"{name}_lower"], out[f"{name}_upper"] = combine_for_maximum(own, solver, own_boot) if how == "max" else joint
    return out


def outside_note(row: dict, statistics: tuple) -> str:
    """Why a reproduced value lies outside its own interval, per statistic ('' when every value is inside).

    Intervals that are quantiles of draws (Table 4's MDC, every MOC, the bootstrap) need not
    contain the value the solver printed: it is one configuration among many, and a value
    in the tail of the draws' distribution is outside a central interval.
    """
    notes = []
    for name, _, _ in statistics:
        value = row.get(name)
        for kind, lo_key, hi_key in (("solver", f"{name}_solver_lower", f"{name}_solver_upper"), ("combined", f"{name}_lower", f"{name}_upper")):
            lo, hi = row.get(lo_key), row.get(hi_key)
            if value is None or lo is None or hi is None or not all(np.isfinite([value, lo, hi])):
                continue
            if not lo <= value <= hi:
                notes.append(f"{name} outside its {kind} interval: that interval is a central range of random draws, and the solver's own configuration lies in their tail")
    return "; ".join(notes)


def deciding_head(df: pd.DataFrame, col: str, prefix: str = "MDC_") -> dict:
    """The head whose per-head ``col`` is the maximum over heads (Table 1's MDC), with its eigengap.

    A maximum over thousands of heads is set by one head: the one printed here.

    Returns:
        ``<prefix>layer``, ``<prefix>head``, ``<prefix>sample_rank``,
        ``<prefix>dataset_index`` and ``<prefix>eigengap`` (the head's ``eigengap_min``,
        smallest relative gap among its selected eigenpairs and at the selection boundary;
        NaN where the records have none). -1 and NaN when no value is finite.
    """
    keys = ("layer", "head", "sample_rank", "dataset_index")
    values = df[col].to_numpy(np.float64)
    if not np.isfinite(values).any():
        return {**{prefix + k: -1 for k in keys}, prefix + "eigengap": float("nan")}
    top = df.iloc[int(np.nanargmax(values))]
    out = {prefix + k: int(top[k]) if k in df else -1 for k in keys}  # -1: not in the records
    out[prefix + "eigengap"] = float(top["eigengap_min"]) if "eigengap_min" in df else float("nan")
    return out


def _with_intervals(row: dict, intervals: dict[str, float], settings: dict, draws: dict | None, statistics: tuple) -> dict:
    """``row`` with the interval columns after the last statistic (KCKA), the settings at the end and
    ``interval_note`` (:func:`outside_note`: why a value lies outside its own interval, '' when none does)."""
    keys = list(row)
    at = keys.index(statistics[-1][0]) + 1
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    tail = {
        "bootstrap_resamples": int(cfg["bootstrap"]),
        "coverage": float(cfg["coverage"]),
        "sign_coverage": float(cfg["sign_coverage"]),
        "sign_draws": int(draws["direct_cos_mean"].shape[1]) if draws is not None else 0,
        "sign_draws_optimal": int(draws["optimal_cos_mean"].shape[1]) if draws is not None else 0,
        "solver_rotations": bool(draws is not None and all(k in draws for k in unc.OPTIONAL_DRAW_NAMES)),
    }
    out = {**{k: row[k] for k in keys[:at]}, **intervals, **{k: row[k] for k in keys[at:]}, **tail}
    out["interval_note"] = outside_note(out, statistics)
    return out


def paper_table(table: Table, heads: pd.DataFrame, meta: dict[str, dict], draws: dict[str, np.ndarray] | None = None, uncertainty: dict | None = None) -> pd.DataFrame:
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
        draws: per-head solver draws (signs and rotations), rows as ``heads`` (:func:`kpca_repro.method.uncertainty.read_sign_draws`).
        uncertainty: with it (``seed``, ``bootstrap``, ``coverage``, ``sign_coverage``), the
            interval columns of :func:`similarity_intervals` (over the aggregated heads) after the
            last statistic and the settings at the end; without it, no interval columns.

    Returns:
        One row per model, in the order of first appearance in ``heads``.

    Raises:
        KeyError: a per-head column of ``table.statistics``, or a model's metadata, is missing.
    """
    rows = []
    for model, df in heads.groupby("model", sort=False):
        df = _head_order(df)
        kept = df[~df["dropped"].astype(bool)] if table.drops else df
        row = {"model": display_name(model), table.id_column: model, **{name: _over_heads(kept[col], how) for name, col, how in table.statistics}, **table.row(df, kept, meta[model])}
        if uncertainty is not None:
            row = _with_intervals(row, similarity_intervals(kept, table.statistics, draws, uncertainty, table.name, model), uncertainty, draws, table.statistics)
        rows.append(row)
    return pd.DataFrame(rows)


def _head_counts(heads: pd.DataFrame, kept: pd.DataFrame, statistics: tuple) -> dict[str, int]:
    """``n_heads_nonfinite`` (of Tables 1 and 4 alike): the aggregated heads with a non-finite value in
    a per-head column of ``statistics``, which the reference's mean propagates (Table 1) or skips
    (Table 4); then the flag counts over all heads (``exp`` overflow, g_i g_j overflow, allclose)."""
    stats = kept[[col for _, col, _ in statistics]].to_numpy(float)
    return {
        "n_heads_nonfinite": int((~np.isfinite(stats)).any(axis=1).sum()),
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


def _over_heads(values: pd.Series, how: str) -> float:
    """A statistic over heads as the references compute it: ``max`` skips NaN (pandas), ``mean``
    propagates it (``np.mean``), ``nanmean`` skips it (pandas' ``mean``); order-independent means."""
    return values.max() if how == "max" else exact_mean(values, skipna=how == "nanmean")


def table_corrected(heads: pd.DataFrame, meta: dict[str, dict], table: Table) -> pd.DataFrame:
    """The corrected variant's table (docs/method.md Section 15), one row per (model, metric).

    For each (per-head column, label, paper statistic) of ``table.corrected``: the paper's
    statistic over heads (``paper_statistic``: max or mean) and its value, mean and standard
    deviation (ddof 1) over heads, the same three for the random Gaussian baseline, the number
    of heads and of non-finite heads (never dropped silently: a non-finite head is counted, and
    excluded from that metric's statistics), the count ``table.count_key`` and the weights.
    """
    rows = []
    for model, df in heads.groupby("model", sort=False):
        df = _head_order(df)
        for col, label, how in table.corrected:
            vals = df[col]
            ok = vals[np.isfinite(vals)]
            base = df.get(f"baseline_{col}", pd.Series(dtype=float))
            base = base[np.isfinite(base)]
            rows.append(
                {
                    "model": display_name(model),
                    table.id_column: model,
                    "metric": label,
                    "column": col,
                    "paper_statistic": f"{how} over heads",
                    "paper_statistic_value": _over_heads(ok, how),
                    "mean": exact_mean(ok),
                    "std": exact_std(ok, ddof=1),
                    "baseline_paper_statistic_value": _over_heads(base, how) if len(base) else float("nan"),
                    "baseline_mean": exact_mean(base),
                    "baseline_std": exact_std(base, ddof=1),
                    "n_heads": len(df),
                    "n_nonfinite": int(len(vals) - len(ok)),
                    table.count_key: meta[model][table.count_key],
                    "weights_sha256": meta[model]["weights_sha256"],
                }
            )
    return pd.DataFrame(rows)


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


def paper_markdown(frame: pd.DataFrame, table: Table) -> str:
    """Markdown of a per-head table, paper variant: the id columns and each statistic (the paper's
    MDC, MOC, LCKA, KCKA of Tables 1 and 4) as ``value [lower, upper]``.

    The interval is the combined one for MDC and MOC (sampling and solver variation) and the
    bootstrap for LCKA and KCKA (docs/uncertainty.md, section 3); a cell without an interval
    shows the value alone. Every other column (solver intervals, deciding head, counts,
    settings) stays in the CSV. Ends with a note on what the intervals are.
    """
    names = [name for name, _, _ in table.statistics]
    rows = []
    for _, r in frame.iterrows():
        cells = {"model": r["model"], table.id_column: r[table.id_column]}
        for name in names:
            lo, hi = r.get(f"{name}_lower"), r.get(f"{name}_upper")
            interval = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None and np.isfinite(lo) and np.isfinite(hi) else ""
            cells[name] = f"{r[name]:.3f}{interval}" if np.isfinite(r[name]) else "NaN"
        rows.append(cells)
    note = (
        "\nIn brackets: for MDC and MOC the interval of sampling and solver variation together, for LCKA and KCKA "
        "the bootstrap over the inputs (docs/uncertainty.md); the CSV beside this file has every other column.\n"
    )
    return markdown_table(pd.DataFrame(rows, columns=["model", table.id_column, *names])) + note


def corrected_markdown(table: pd.DataFrame, metrics: tuple = CORRECTED_METRICS) -> str:
    """Markdown: one row per model, one column per metric, ``mean ± std (random: mean)``."""
    cells = table.assign(cell=[f"{m:.3f} ± {s:.3f} (random {b:.3f})" for m, s, b in zip(table["mean"], table["std"], table["baseline_mean"])])
    wide = cells.pivot(index="model", columns="metric", values="cell")
    order = list(dict.fromkeys(table["model"]))
    wide = wide.loc[order, [label for _, label, _ in metrics if label in wide.columns]]
    counts = table.groupby("model", sort=False)[["n_heads", "n_nonfinite"]].max()
    wide["heads (non-finite)"] = [f"{counts.loc[m, 'n_heads']} ({counts.loc[m, 'n_nonfinite']})" for m in wide.index]
    return markdown_table(wide.reset_index())


SPECTRUM_STATS = ("max", "min", "mean", "median")


def spectrum_statistics(eigenvalues: np.ndarray) -> dict[str, float]:
    """Table 2/3 statistics of one model (docs/method.md Section 4), in units of 1e-6.

    Per image: the rank-wise mean of ``|lambda_r|`` over all (layer, head) pairs (a NaN head
    makes that image's vector NaN, as ``np.mean`` does in the reference), then that vector's
    max, min, mean and *lower* median (``torch.median``: element ``(R-1)//2`` of the sorted
    vector). Across images: mean and unbiased standard deviation of each statistic.

    Args:
        eigenvalues: shape ``(images, layers * heads, R)``, float.

    Returns:
        ``{"max_mean": .., "max_std": .., ..., "median_std": ..}`` (x 1e6), plus
        ``n_images``, ``n_heads`` and ``n_nonfinite_heads``.
    """
    stats = _per_image_spectrum(eigenvalues)
    r = eigenvalues.shape[2]
    out: dict[str, float] = {}
    for name in SPECTRUM_STATS:
        out[f"{name}_mean"] = float(stats[name].mean() * 1e6)
        out[f"{name}_std"] = float(stats[name].std(ddof=1) * 1e6) if len(stats[name]) > 1 else float("nan")
    heads = eigenvalues.reshape(-1, r)
    out["n_images"] = int(eigenvalues.shape[0])
    out["n_heads"] = int(heads.shape[0])
    out["n_nonfinite_heads"] = int((~np.isfinite(heads).all(axis=1)).sum())
    return out


def _per_image_spectrum(eigenvalues: np.ndarray) -> dict[str, np.ndarray]:
    """Per image ``(images,)``: max, min, mean and lower median of the rank-wise mean over heads."""
    per_image = eigenvalues.mean(axis=1)  # (images, R)
    r = per_image.shape[1]
    return {
        "max": per_image.max(axis=1),
        "min": per_image.min(axis=1),
        "mean": per_image.mean(axis=1),
        "median": np.sort(per_image, axis=1)[:, (r - 1) // 2],
    }


def spectrum_intervals(eigenvalues: np.ndarray, settings: dict, model: str, keys: str) -> dict[str, float]:
    """Percentile-bootstrap intervals over images of every Table 2/3 cell (x 1e-6).

    Each replicate resamples the images with replacement and recomputes the mean and the
    standard deviation (ddof 1) over images of each per-image statistic. The generator is
    seeded by (``seed``, ``"spectra"``, model, keys), so Table 2 and Table 3 give the
    standardized columns the same intervals.

    Args:
        eigenvalues: ``(images, layers * heads, R)`` (:func:`eigenvalue_array`).
        settings: ``seed``, ``bootstrap``, ``coverage``.

    Returns:
        ``{"max_mean_lower": .., "max_mean_upper": .., "max_std_lower": .., ...}``.
    """
    cfg = {**UNCERTAINTY_DEFAULTS, **settings}
    stats = _per_image_spectrum(eigenvalues)
    n = eigenvalues.shape[0]
    idx = unc.bootstrap_indices(np.random.default_rng(unc.stable_seed(cfg["seed"], "spectra", model, keys)), n, int(cfg["bootstrap"]))
    out: dict[str, float] = {}
    for name in SPECTRUM_STATS:
        sample = stats[name][idx] * 1e6  # (B, images)
        for what, values in (("mean", sample.mean(axis=1)), ("std", sample.std(axis=1, ddof=1) if n > 1 else np.full(len(sample), np.nan))):
            out[f"{name}_{what}_lower"], out[f"{name}_{what}_upper"] = unc.percentile_interval(values, cfg["coverage"])
    return out


def eigenvalue_array(records: pd.DataFrame) -> np.ndarray:
    """``(images, layers * heads, R)`` array from per-head eigenvalue records (``lambda_*`` columns)."""
    cols = [c for c in records.columns if c.startswith("lambda_")]
    ordered = records.sort_values(["sample_rank", "layer", "head"])
    n_img = ordered["sample_rank"].nunique()
    return ordered[cols].to_numpy(dtype=np.float64).reshape(n_img, -1, len(cols))


def table_spectra(records: dict[tuple[str, str], pd.DataFrame], uncertainty: dict | None = None) -> pd.DataFrame:
    """Table 2 (``keys == "standardized"``) or Table 3 rows from per-head eigenvalue records.

    Args:
        records: ``(model id, keys)`` -> records, ``keys`` in ``{"standardized", "raw"}``.

    Returns:
        One row per model. With both key treatments present (Table 3): the standardized
        statistics, the unstandardized ones (suffix ``_raw``) and the percentage change
        ``(raw / standardized - 1) * 100`` per statistic. With ``uncertainty`` (``seed``,
        ``bootstrap``, ``coverage``), then the bootstrap bounds of every mean and std cell
        (:func:`spectrum_intervals`): ``<cell>_lower``, ``<cell>_upper`` (``max_mean_lower``,
        ``max_mean_raw_lower``, ...).
    """
    models = list(dict.fromkeys(m for m, _ in records))
    rows = []
    for model in models:
        row: dict = {"model": display_name(model), "timm_id": model}
        std = spectrum_statistics(eigenvalue_array(records[(model, "standardized")])) if (model, "standardized") in records else None
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
                    row.update({k.replace("_lower", f"{suffix}_lower").replace("_upper", f"{suffix}_upper"): v for k, v in bounds.items()})
            row["bootstrap_resamples"] = int({**UNCERTAINTY_DEFAULTS, **uncertainty}["bootstrap"])
            row["coverage"] = float({**UNCERTAINTY_DEFAULTS, **uncertainty}["coverage"])
        rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Table:
    """One table of the paper: what it reads, how each variant aggregates it, what it is compared with.

    The rule ``table`` (``{table}``: :data:`TABLES`' names) and its script, rule ``all``, the
    report (:mod:`kpca_repro.workflow.paths`) and the comparison with the published numbers
    (:mod:`kpca_repro.analysis.comparison`) read a table only from here (docs/internals.md, "Tables").

    Attributes:
        name: ``table<N>``: ``results/<name><suffix>.csv|.md`` per variant, the report page
            ``results/html/<name><suffix>.html``, "Table <N>" in the comparison.
        domain: ``"vision"`` (id column ``timm_id``, count ``n_images``) or ``"text"``
            (``hf_id``, ``n_sentences``): the models of ``<domain>.models`` and the
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
        caption: reST of its report pages (``workflow/report/tables.rst`` adds the variant).

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

    def __post_init__(self):
        if not re.fullmatch(r"table\w+", self.name) or self.domain not in ("vision", "text") or not (self.row or self.keys):
            raise ValueError(f"table {self.name!r}: a name table<N>, the domain vision or text, and a row function or key treatments")

    @property
    def title(self) -> str:
        return "Table " + self.name.removeprefix("table")

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
groups, joined with the reproduced value; LCKA and KCKA vary the sample only. ``MDC_layer``, ``MDC_head``, ``MDC_sample_rank``
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
    )
}
