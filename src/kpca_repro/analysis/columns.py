"""What every column of every results CSV means: the registry (:data:`SCHEMAS`), the CSVW
metadata written beside each results CSV, and the page docs/columns.md.

One :class:`Schema` per kind of CSV (the tables, the comparison, the figures' data, the training
summaries, and the per-head and per-layer records the jobs pass on). A :class:`Column` names one
column or a family of columns: ``<stat>_<what>`` stands for every name whose ``<...>`` parts
take a value of the schema's placeholders, and the description's ``<...>`` becomes that
value's words. The per-head tables' statistics (``MDC``, ``LCKA``, ... of
:data:`kpca_repro.analysis.tables.TABLES`) are described from their entries by
:func:`statistic_columns`, so a table added to that registry is described by its statistics.

Every CSV under ``results/`` has ``<name>.csv-metadata.json`` beside it (W3C CSVW, the name a CSVW
processor looks for): the table's title and, per column in file order, its name, datatype,
``dc:description`` and ``schema:unitText`` (unit or range); a CSVW validator (``csvwvalidate``)
accepts it with its CSV (tests/test_workflow.py). The job that writes a table or figure writes its
metadata; the records of the method's jobs (``results/heads``, ``results/spectra``,
``results/figure3/gamma_*``) get theirs from the local rule ``records_metadata``
(workflow/rules/metadata.smk), because those jobs import nothing of ``analysis``: an edit of a
description reruns that rule, never the KPCA work (tests/test_code_deps.py). :func:`describe` raises
on a column no entry describes, so an unexplained column fails its job before anything is
written. This module imports nothing of the package: the figure and training jobs use it
without the method.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = [
    "Column",
    "Schema",
    "SCHEMAS",
    "UndescribedColumnError",
    "statistic_columns",
    "describe",
    "metadata",
    "metadata_json",
    "markdown_page",
]


@dataclass(frozen=True)
class Column:
    """One column, or a family of columns, of a results CSV.

    Attributes:
        name: the column's name, or a pattern whose ``<placeholder>`` parts take the values of
            the schema's :attr:`Schema.placeholders` (``lambda_<r>``, ``<stat>_<what>_lower``).
        description: what it is; ``<placeholder>`` is replaced by the matched value's words.
        unit: unit or range (``cosine in [-1, 1]``, ``count``, ``× 10⁻⁶``, ``text``).
        variants: where not every file of the schema has it: ``"paper"``, ``"corrected"``,
            ``"Table 1"``, ... ("" for all).
    """

    name: str
    description: str
    unit: str
    variants: str = ""


@dataclass(frozen=True)
class Schema:
    """The columns of one kind of results CSV.

    Attributes:
        title: a heading (docs/columns.md).
        files: which files have these columns.
        columns: the entries, looked up in order (the first whose name matches describes a column).
        placeholders: ``<name>`` -> its values: a mapping value -> words, or a regular expression
            (the value is its own word).
    """

    title: str
    files: str
    columns: tuple[Column, ...]
    placeholders: dict[str, dict[str, str] | str] = field(default_factory=dict)


class UndescribedColumnError(KeyError):
    """A CSV column that no entry of its schema describes (the message names it and the schema)."""

    def __str__(self) -> str:
        return str(self.args[0])


# --------------------------------------------------------------------------------------
# Shared entries
# --------------------------------------------------------------------------------------

_MODEL = Column(
    "model",
    "the model's short name in the paper (DeiT-Tiny, MiniLM, ...) or its id; ' (stand-in weights)' or ' (user "
    "activations)' appended for such rows",
    "text",
)
_TIMM_ID = Column("timm_id", "the timm model id (config vision.models)", "text", "vision tables")
_HF_ID = Column(
    "hf_id", "the Hugging Face model id (config text.models, decoders.models)", "text", "text and decoder tables"
)
_MODEL_ID = Column("model", "the model id (timm or Hugging Face) of the activation files", "text")
_VARIANT = Column(
    "variant",
    "the variant that computed the row: paper (the authors' code) or corrected (docs/results.md, 'The two variants')",
    "paper | corrected",
)
_N_IMAGES = Column("n_images", "images analysed (summed over shards)", "count", "vision tables")
_N_SENTENCES = Column("n_sentences", "WikiText rows (sentences) analysed (summed over shards)", "count", "text tables")
_SHA = Column("weights_sha256", "SHA-256 of the weights file the activations were extracted with", "hex digest")
_BOOTSTRAP = Column(
    "bootstrap_resamples",
    "replicates of the percentile bootstrap over the inputs (config uncertainty.bootstrap)",
    "count",
)
_COVERAGE = Column(
    "coverage", "central coverage of the bootstrap intervals (config uncertainty.coverage)", "fraction in (0, 1)"
)
_LAYER = Column("layer", "transformer block, 0-based", "index")
_HEAD = Column("head", "attention head within the layer, 0-based", "index")
_SAMPLE_RANK = Column(
    "sample_rank", "the input's rank in the seeded draw of images or sentences (docs/method.md 1)", "index"
)
_DATASET_INDEX = Column("dataset_index", "the input's index in the image list or the dataset's rows", "index")
_COSINE = "cosine in [-1, 1]"

# --------------------------------------------------------------------------------------
# Per-head records: results/heads/<variant>/<model>/<stem>.csv (rule kpca_heads)
# --------------------------------------------------------------------------------------

#: Per-head metric columns (the records' similarity statistics), also the values of ``<col>``.
_HEAD_METRICS = {
    "direct_cos_mean": (
        "mean over tokens i of the direct cosine cos(v_i, v^KPCA_i) between row i of V and row i of V_KPCA",
        _COSINE,
    ),
    "direct_cos_max": ("largest direct cosine cos(v_i, v^KPCA_i) over the tokens i", _COSINE),
    "direct_cos_min": ("smallest direct cosine cos(v_i, v^KPCA_i) over the tokens i", _COSINE),
    "direct_cos_frac_negative": ("share of tokens whose direct cosine is negative", "fraction in [0, 1]"),
    "optimal_cos_mean": (
        "mean over tokens of the cosine between each row of V and the row of V_KPCA the optimal (Hungarian) token "
        "matching assigns to it",
        _COSINE,
    ),
    "optimal_cos_max": ("largest matched cosine over tokens (optimal token matching)", _COSINE),
    "optimal_cos_min": ("smallest matched cosine over tokens (optimal token matching)", _COSINE),
    "linear_cka": ("linear CKA between V and V_KPCA (docs/method.md 2)", "[0, 1]"),
    "rbf_cka": ("RBF-kernel CKA between V and V_KPCA, bandwidth the median distance (docs/method.md 2)", "[0, 1]"),
    "direct_abs_cos_columns": (
        "mean over the d columns c of |cos| between column c of V and column c of V_KPCA (docs/method.md 15.3)",
        "[0, 1]",
    ),
    "optimal_abs_cos_columns": (
        "mean |cos| between the columns of V and of V_KPCA under the optimal column matching (docs/method.md 15.3)",
        "[0, 1]",
    ),
    "linear_cka_unbiased": (
        "linear CKA between V and V_KPCA with the unbiased HSIC estimator of Song et al. 2012 (near 0 for unrelated "
        "matrices at any N; NaN for N < 4; docs/method.md 17.2)",
        "≤ 1",
    ),
    "rbf_cka_unbiased": (
        "RBF-kernel CKA between V and V_KPCA with the unbiased HSIC estimator (docs/method.md 17.2)",
        "≤ 1",
    ),
    "projection_cos": (
        "mean over the tested queries i of cos(ĥ_i, h_i), ĥ_i = Σ_j softmax_j(s q_i·k_j) V_KPCA_j the claimed "
        "projection, h_i the attention's output (docs/method.md 17.3)",
        _COSINE,
    ),
    "projection_rel_error": (
        "‖Ĥ − H‖_F / ‖H‖_F over the tested queries, V_KPCA at its true scale (docs/method.md 17.3)",
        "≥ 0",
    ),
    "projection_norm_ratio": ("‖Ĥ‖_F / ‖H‖_F over the tested queries (docs/method.md 17.3)", "≥ 0"),
}
_CORRECTED_ONLY = ("direct_abs_cos_columns", "optimal_abs_cos_columns", "linear_cka_unbiased", "rbf_cka_unbiased")
#: The per-head columns with an all-components control (docs/method.md 17), also the values of ``<ctl>``.
_CONTROLS = {
    "linear_cka": "linear CKA",
    "rbf_cka": "RBF CKA",
    "linear_cka_unbiased": "unbiased linear CKA",
    "rbf_cka_unbiased": "unbiased RBF CKA",
    "projection_norm_ratio": (
        "the largest ‖Ĥ‖_F / ‖H‖_F that any principal directions reach, ‖H G Sᵀ‖_F / ‖H‖_F; projection_rel_error "
        "≥ 1 − it"
    ),
}

_HEADS = Schema(
    "Per-head records",
    "`results/heads/<variant>/<model>/<stem>.csv` (rules `kpca_heads`, `kpca_prefix`; metadata: rule "
    "`records_metadata`): one row per (input, layer, head), the records Tables 1 and 4 aggregate",
    (
        _MODEL_ID,
        _VARIANT,
        _SAMPLE_RANK,
        _DATASET_INDEX,
        _LAYER,
        _HEAD,
        Column("n_tokens", "N, the tokens of the head (paper text variant: the padded length)", "count"),
        Column("head_dim", "d, the head dimension", "count"),
        Column("exp_overflow", "some exp(s k_i·k_j) of the Gram matrix overflows float32", "bool", "paper"),
        Column(
            "outer_overflow",
            "g_i g_j overflows float32 while g is finite: those Gram entries are zeroed, the head kept",
            "bool",
            "paper",
        ),
        Column("finite", "the centered Gram matrix is finite", "bool"),
        Column(
            "dropped",
            "the reference would drop the head (non-finite centered Gram matrix or V_KPCA): its statistics are NaN "
            "(the paper variant's text reading: matched cosines and the negative share 0, as the reference sets them)",
            "bool",
        ),
        Column("allclose", "torch.allclose(V, V_KPCA, rtol=1e-3, atol=1e-5) holds", "bool"),
        *(
            Column(name, text, unit, "corrected" if name in _CORRECTED_ONLY else "")
            for name, (text, unit) in _HEAD_METRICS.items()
        ),
        Column(
            "baseline_<col>",
            "<col> with a standard normal matrix in place of V_KPCA, seeded by (seed, input, layer)",
            "as <col>",
            "corrected",
        ),
        Column(
            "control_<ctl>",
            "the all-components control of <ctl>: V against G H, what the normaliser g alone gives, equal to the "
            "metric where every direction is kept (docs/method.md 17)",
            "as the metric",
            "corrected; projection: decoders too",
        ),
        Column(
            "n_centered_directions",
            "N − 1, the directions of the centered feature space of the N keys (the most non-zero eigenvalues the "
            "centered Gram matrix has)",
            "count",
        ),
        Column("n_components", "eigenvectors kept, min(d, N)", "count"),
        Column(
            "all_directions_kept",
            "n_components ≥ N − 1 (N ≤ d + 1): the kept eigenvectors span the whole centered space, so V_KPCA "
            "V_KPCAᵀ = G H G and CKA tests only g (docs/method.md 17.1)",
            "bool",
        ),
        Column(
            "eigengap_min",
            "smallest relative eigengap |λ_i − λ_j| / ‖K‖₂ between neighbouring eigenvalues of which one is selected "
            "(among the selected and at the selection boundary; docs/uncertainty.md 2b)",
            "≥ 0",
            "paper",
        ),
        Column(
            "solver_groups",
            "near-degenerate eigenvalue groups (gap below the float32 solver's tolerance) touching the selection",
            "count",
            "paper",
        ),
        Column("solver_group_max", "size of the largest such group (1: none)", "count", "paper"),
        Column(
            "solver_boundary_group", "a near-degenerate group straddles the top-d selection boundary", "bool", "paper"
        ),
    ),
    {
        "col": {name: f"`{name}`" for name in _HEAD_METRICS},
        "ctl": {name: f"`{name}` ({text})" for name, text in _CONTROLS.items()},
    },
)

# --------------------------------------------------------------------------------------
# Tables 1 and 4, paper variant: results/table1.csv, results/table4.csv (rule table)
# --------------------------------------------------------------------------------------

#: How a per-head table aggregates a per-head column (:data:`kpca_repro.analysis.tables.TABLES`' ``statistics``).
_OVER_HEADS = {
    "max": "maximum over the heads the table aggregates (NaN skipped) of",
    "mean": "mean over the heads the table aggregates (a NaN propagates, as np.mean) of",
    "nanmean": "mean over every head, NaN skipped, of",
}


def statistic_columns(statistics: tuple[tuple[str, str, str], ...]) -> tuple[Column, ...]:
    """The entries of a per-head table's statistics and their intervals.

    Args:
        statistics: the table's ``(column, per-head column, "max" | "mean" | "nanmean")`` triples
            (``Table.statistics`` of :data:`kpca_repro.analysis.tables.TABLES`).

    Returns:
        Per statistic ``S``: ``S`` itself (its aggregation of the per-head column, described as
        the records describe that column), ``S_lower`` / ``S_upper`` and ``S_solver_lower`` /
        ``S_solver_upper`` (docs/uncertainty.md 3).

    Raises:
        ValueError: an aggregation other than max, mean, nanmean.
    """
    out = []
    for name, col, how in statistics:
        if how not in _OVER_HEADS:
            raise ValueError(f"statistic {name}: unknown aggregation {how!r}; expected one of {sorted(_OVER_HEADS)}")
        text, unit = _HEAD_METRICS.get(col, (f"the per-head column {col}", "as the per-head column"))
        out += [
            Column(name, f"{_OVER_HEADS[how]} the per-head `{col}`: {text}", unit),
            Column(
                f"{name}_lower",
                f"lower end of {name}'s interval: the percentile bootstrap over the inputs (coverage `coverage`), "
                "for a statistic with solver draws (MDC, MOC) combined with the solver variation "
                "(docs/uncertainty.md 3)",
                unit,
            ),
            Column(f"{name}_upper", f"upper end of {name}'s interval (as `{name}_lower`)", unit),
            Column(
                f"{name}_solver_lower",
                "lower end of what the eigensolver's freedom (each eigenvector's sign, rotations inside "
                f"near-degenerate eigenspaces) can print for {name} "
                "on all inputs (docs/uncertainty.md 2-3); NaN without solver draws",
                unit,
            ),
            Column(f"{name}_solver_upper", f"upper end of {name}'s solver interval (as `{name}_solver_lower`)", unit),
        ]
    return tuple(out)


#: The projection test's means over heads (docs/method.md 17.3): the decoders' table and profile.
_PROJECTION_MEANS = (
    Column(
        "projection_cos",
        "mean over heads (NaN skipped) of the per-head cos(ĥ, h) of the projection test at the last real token "
        "(docs/method.md 17.3)",
        _COSINE,
        "decoders",
    ),
    Column(
        "projection_rel_error",
        "mean over heads (NaN skipped) of ‖ĥ − h‖ / ‖h‖ of the projection test",
        "≥ 0",
        "decoders",
    ),
    Column(
        "projection_norm_ratio", "mean over heads (NaN skipped) of ‖ĥ‖ / ‖h‖ of the projection test", "≥ 0", "decoders"
    ),
    Column(
        "control_projection_norm_ratio",
        "mean over heads (NaN skipped) of the largest ‖ĥ‖ / ‖h‖ any principal directions reach (all components)",
        "≥ 0",
        "decoders",
    ),
)

_PER_HEAD_TABLE = Schema(
    "Tables 1 and 4, `paper` variant",
    "`results/table1.csv`, `results/table4.csv` (and every per-head table of the registry `TABLES`): one row per "
    "model, "
    "its statistics over heads of the per-head records with their intervals (docs/method.md 2-3, docs/uncertainty.md "
    "3)",
    (
        _MODEL,
        _TIMM_ID,
        _HF_ID,
        Column(
            "MDC_mean_over_heads",
            "mean over the kept heads (NaN skipped) of the per-head `direct_cos_mean`, beside MDC, their maximum",
            _COSINE,
            "Table 1",
        ),
        Column(
            "MOC_mean_over_heads",
            "mean over the kept heads (NaN skipped) of the per-head `optimal_cos_mean`, beside MOC, their maximum",
            _COSINE,
            "Table 1",
        ),
        Column(
            "MDC_table1_statistic",
            "Table 1's MDC on these records: maximum over heads of the per-head `direct_cos_mean`",
            _COSINE,
            "Table 4",
        ),
        Column(
            "MOC_table1_statistic",
            "Table 1's MOC on these records: maximum over heads of the per-head `optimal_cos_mean`",
            _COSINE,
            "Table 4",
        ),
        Column(
            "<decided>_layer",
            "layer of the head whose `direct_cos_mean` is the maximum, the head that decides <decided>; -1 when no "
            "value is finite",
            "index",
        ),
        Column("<decided>_head", "head index of the head that decides <decided>; -1 when no value is finite", "index"),
        Column(
            "<decided>_sample_rank",
            "`sample_rank` of the input of the head that decides <decided>; -1 when no value is finite",
            "index",
        ),
        Column(
            "<decided>_dataset_index",
            "`dataset_index` of the input of the head that decides <decided>; -1 when no value is finite",
            "index",
        ),
        Column(
            "<decided>_eigengap",
            "`eigengap_min` of the head that decides <decided>: a tiny gap means the solver's rotation in that one "
            "head moves the statistic (docs/uncertainty.md 2b)",
            "≥ 0",
        ),
        _N_IMAGES,
        _N_SENTENCES,
        Column("n_heads", "heads in the records: inputs × layers × heads", "count"),
        Column("n_heads_analysed", "heads the table aggregates: those the reference does not drop", "count", "Table 1"),
        Column(
            "n_heads_dropped",
            "heads the reference drops (non-finite centered Gram matrix or V_KPCA), left out of every statistic",
            "count",
            "Table 1",
        ),
        Column(
            "n_heads_nonfinite",
            "aggregated heads with a non-finite value in a per-head column of the statistics (Table 1: kept, their "
            "NaN makes a mean NaN; Table 4: skipped by the means)",
            "count",
        ),
        Column("n_exp_overflow", "heads whose exp(s k_i·k_j) overflows float32", "count"),
        Column(
            "n_outer_overflow",
            "heads whose g_i g_j overflows float32: their Gram entries are zeroed and the heads kept",
            "count",
        ),
        Column("n_allclose", "heads where torch.allclose(V, V_KPCA, rtol=1e-3, atol=1e-5) holds", "count"),
        *_PROJECTION_MEANS,
        Column(
            "n_heads_all_directions_kept",
            "heads with N ≤ d + 1, whose kept eigenvectors span the whole centered space (docs/method.md 17.1)",
            "count",
            "decoders",
        ),
        Column("n_query_heads", "query heads per layer", "count", "decoders"),
        Column(
            "n_kv_heads",
            "key-value heads per layer, the heads of the records: fewer than the query heads with grouped-query "
            "attention (docs/method.md 16)",
            "count",
            "decoders",
        ),
        Column(
            "n_tokens",
            "N, the largest token count of a head (Table 4: the padded length; decoders: the longest row's real "
            "tokens)",
            "count",
            "Table 4, decoders",
        ),
        Column(
            "longformer_transposed",
            "the activations were stored from Longformer's (sequence, batch) layout and read as the reference "
            "misreads them (docs/results.md, Table 4)",
            "bool",
            "Table 4",
        ),
        _SHA,
        _BOOTSTRAP,
        _COVERAGE,
        Column(
            "sign_coverage",
            "central coverage of the solver draws in the solver intervals (config uncertainty.sign_coverage)",
            "fraction in (0, 1)",
        ),
        Column(
            "sign_draws",
            "stored solver draws per head of the closed-form direct statistics (config uncertainty.sign_draws); 0: "
            "none",
            "count",
        ),
        Column(
            "sign_draws_optimal",
            "stored solver draws per head of the matched cosines (config uncertainty.sign_draws_optimal; "
            "uncertainty.sign_draws_optimal_text for language-model heads); 0: none",
            "count",
        ),
        Column(
            "solver_rotations", "the draws vary rotations inside near-degenerate eigenspaces as well as signs", "bool"
        ),
        Column(
            "interval_note",
            "why a reproduced value lies outside its own interval; empty when every value is inside",
            "text",
        ),
    ),
    {"decided": {"MDC": "MDC (Table 1)", "MDC_table1_statistic": "MDC_table1_statistic (Table 4)"}},
)

# --------------------------------------------------------------------------------------
# Tables 1 and 4, corrected variant (rule table)
# --------------------------------------------------------------------------------------

_CORRECTED_TABLE = Schema(
    "Tables 1 and 4, `corrected` variant",
    "`results/table1_corrected.csv`, `results/table4_corrected.csv`: one row per (model, metric), each metric beside "
    "a random Gaussian baseline (docs/method.md 15)",
    (
        _MODEL,
        _TIMM_ID,
        _HF_ID,
        Column("metric", "the metric's label (direct cosine (token rows), linear CKA, ...)", "text"),
        Column("column", "the per-head records column it aggregates (`direct_cos_mean`, `linear_cka`, ...)", "text"),
        Column(
            "paper_statistic", "the paper's statistic over heads for this metric", "max over heads | mean over heads"
        ),
        Column("paper_statistic_value", "that statistic over the heads with a finite value", "as the metric"),
        Column("mean", "mean over the heads with a finite value", "as the metric"),
        Column("std", "standard deviation over the heads with a finite value (ddof 1)", "as the metric"),
        Column(
            "baseline_paper_statistic_value",
            "the paper's statistic of the metric against a random Gaussian V_KPCA (`baseline_<column>`)",
            "as the metric",
        ),
        Column("baseline_mean", "mean over heads of the metric against the random baseline", "as the metric"),
        Column(
            "baseline_std",
            "standard deviation over heads (ddof 1) of the metric against the random baseline",
            "as the metric",
        ),
        Column(
            "control_paper_statistic_value",
            "the paper's statistic of the all-components control (`control_<column>`: V against G H, what g alone "
            "gives; NaN for a metric without one; docs/method.md 17)",
            "as the metric",
        ),
        Column("control_mean", "mean over heads of the all-components control", "as the metric"),
        Column("control_std", "standard deviation over heads (ddof 1) of the all-components control", "as the metric"),
        Column("n_heads", "heads in the records: inputs × layers × heads", "count"),
        Column("n_nonfinite", "heads whose value of this metric is not finite, left out of its statistics", "count"),
        Column(
            "n_all_directions_kept",
            "CKA metrics: heads with N ≤ d + 1, whose kept eigenvectors span the whole centered space, left out of "
            "the statistics "
            "(their CKA is the control's; docs/method.md 17.1); 0 for the other metrics",
            "count",
        ),
        _N_IMAGES,
        _N_SENTENCES,
        _SHA,
    ),
)

# --------------------------------------------------------------------------------------
# Tables 2 and 3 (rule table)
# --------------------------------------------------------------------------------------

_STAT = {"max": "largest", "min": "smallest", "mean": "mean", "median": "lower median"}
_WHAT = {"mean": "mean", "std": "standard deviation (ddof 1)"}
_SPECTRUM_CELL = (
    "<what> over images of the per-image <stat> of the rank-wise mean over layers × heads of the top eigenvalues "
    "of the centered Gram matrix"
)
_SPECTRUM_UNIT = "10⁻⁶ (the number is the eigenvalue × 10⁶)"

_SPECTRUM_TABLE = Schema(
    "Tables 2 and 3",
    "`results/table2.csv`, `results/table3.csv` and their `_corrected` files: one row per model; keys standardized "
    "per token, Table 3 also raw (docs/method.md 4-5)",
    (
        _MODEL,
        _TIMM_ID,
        _VARIANT,
        Column("<stat>_<what>", f"{_SPECTRUM_CELL}, standardized keys", _SPECTRUM_UNIT),
        Column("<stat>_<what>_raw", f"{_SPECTRUM_CELL}, raw (unstandardized) keys", _SPECTRUM_UNIT, "Table 3"),
        Column(
            "<stat>_<what>_lower",
            "lower end of the percentile bootstrap over images of `<stat>_<what>` (coverage `coverage`)",
            _SPECTRUM_UNIT,
        ),
        Column(
            "<stat>_<what>_upper",
            "upper end of the percentile bootstrap over images of `<stat>_<what>`",
            _SPECTRUM_UNIT,
        ),
        Column(
            "<stat>_<what>_raw_lower",
            "lower end of the percentile bootstrap over images of `<stat>_<what>_raw`",
            _SPECTRUM_UNIT,
            "Table 3",
        ),
        Column(
            "<stat>_<what>_raw_upper",
            "upper end of the percentile bootstrap over images of `<stat>_<what>_raw`",
            _SPECTRUM_UNIT,
            "Table 3",
        ),
        Column(
            "<stat>_change_pct",
            "change without standardization: (`<stat>_mean_raw` / `<stat>_mean` − 1) × 100",
            "%",
            "Table 3",
        ),
        Column("n_images", "images analysed, standardized keys", "count"),
        Column("n_heads", "heads analysed, standardized keys: images × layers × heads", "count"),
        Column(
            "n_nonfinite_heads",
            "heads with a non-finite eigenvalue, standardized keys (they make their image's statistics NaN)",
            "count",
        ),
        Column("n_images_raw", "images analysed, raw keys", "count", "Table 3"),
        Column("n_heads_raw", "heads analysed, raw keys", "count", "Table 3"),
        Column(
            "n_nonfinite_heads_raw",
            "heads with a non-finite eigenvalue, raw keys (paper: float32 exp overflow)",
            "count",
            "Table 3",
        ),
        _BOOTSTRAP,
        _COVERAGE,
    ),
    {"stat": _STAT, "what": _WHAT},
)

# --------------------------------------------------------------------------------------
# The comparison: results/paper_comparison.csv (rule paper_comparison)
# --------------------------------------------------------------------------------------

_COMPARISON = Schema(
    "Published against reproduced",
    "`results/paper_comparison.csv`: one row per published number of Tables 1-4 (docs/uncertainty.md 4)",
    (
        Column("table", "the paper's table", "Table 1 .. Table 4"),
        Column("model", "the model's name as the paper prints it", "text"),
        Column("model_id", "its timm or Hugging Face id", "text"),
        Column("column", "the published column (MDC, max_mean, ...)", "text"),
        Column("published", "the published number; empty where the source is unreadable", "as the column"),
        Column("reproduced", "the `paper` variant's value of that column; empty when not run", "as the column"),
        Column(
            "lower", "lower end of the reproduced value's interval (`<column>_lower` of the table)", "as the column"
        ),
        Column("upper", "upper end of the reproduced value's interval (`<column>_upper`)", "as the column"),
        Column(
            "solver_lower",
            "lower end of the solver interval (`<column>_solver_lower`; MDC and MOC only)",
            "as the column",
        ),
        Column(
            "solver_upper",
            "upper end of the solver interval (`<column>_solver_upper`; MDC and MOC only)",
            "as the column",
        ),
        Column("corrected", "the `corrected` variant's value of the same statistic", "as the column"),
        Column("difference", "reproduced − published", "as the column"),
        Column(
            "status",
            "within rounding, consistent with (or differs beyond) sampling and solver variation, consistent with (or "
            "differs beyond) sampling variation, not comparable, not run, not published",
            "text",
        ),
        Column(
            "reason", "why a number is not comparable, not run or not published, or why an interval is missing", "text"
        ),
        Column("source", "where the published number comes from", "text"),
    ),
)

# --------------------------------------------------------------------------------------
# Figures 2 and 5 (rules norms_vision, norms_text, figure2, figure5)
# --------------------------------------------------------------------------------------

_NORMS = Schema(
    "Figures 2 and 5 (and the decoders'): squared norms per layer",
    "`results/figure2.csv`, `results/figure5.csv`, `results/figure_decoders_norms.csv` and their `_corrected` files "
    "(rules `figure2`, `figure5`, "
    "`figure_decoders_norms`), and the per-model records `results/norms/<variant>/<model>/{vision,text,decoder}.csv` "
    "they concatenate (rules `norms_vision`, `norms_text`, `norms_decoder`): "
    "one row per (model, layer, quantity), the values pooled over inputs, heads and tokens (docs/method.md 8-9, 15)",
    (
        _MODEL_ID,
        _VARIANT,
        _LAYER,
        Column("quantity", "phi: ‖φ(q_i)‖²; h: ‖h_i‖²", "phi | h"),
        Column("n_sequences", "images or sentences pooled", "count"),
        Column("head_dim", "d, the head dimension", "count"),
        Column(
            "scale", "s of ‖φ(q_i)‖² = exp(s‖q_i‖²) / g(q_i)²: 1/8 hard-coded (paper), 1/√head_dim (corrected)", "> 0"
        ),
        Column(
            "trim_percentile",
            "values above this percentile are dropped before the statistics; empty: no trim (corrected)",
            "percentile",
        ),
        Column("band", "the percentiles of the shaded band", "25-75 (paper) | 2.5-97.5 (corrected)"),
        Column("n_values", "finite values pooled", "count"),
        Column("n_nonfinite", "non-finite values, left out", "count"),
        Column("n_kept", "values after the trim", "count"),
        Column("trim_threshold", "the trim percentile's value; empty without trim", "squared norm"),
        Column("median", "median of the kept values", "squared norm"),
        Column("q25", "25th percentile of the kept values", "squared norm"),
        Column("q75", "75th percentile of the kept values", "squared norm"),
        Column("band_lower", "lower percentile of the band (`band`) of the kept values", "squared norm"),
        Column("band_upper", "upper percentile of the band of the kept values", "squared norm"),
        Column("mean", "mean of the kept values", "squared norm"),
        Column("min", "smallest kept value", "squared norm"),
        Column("max", "largest kept value", "squared norm"),
        Column("mean_all", "mean of every finite value, before the trim", "squared norm"),
    ),
)

# --------------------------------------------------------------------------------------
# Figure 3 (rules gamma_vision, figure3)
# --------------------------------------------------------------------------------------

_EIGENVECTORS = Column(
    "eigenvectors",
    "true: the eigenvectors A of the centered Gram matrix; perturbed: QR(A + noise · N(0, 1))",
    "true | perturbed",
)
_COMPONENT = Column("component", "principal component, 0-based", "index")

_FIGURE3 = Schema(
    "Figure 3: the γ-constancy test",
    "`results/figure3.csv`, `results/figure3_corrected.csv` (rule `figure3`): one row per (eigenvectors, measure, "
    "component), over the heads of the block (docs/method.md 10)",
    (
        _EIGENVECTORS,
        Column(
            "measure",
            "abs_mean: mean over token pairs of |γ_i − γ_j|; rel_mean: of |γ_i − γ_j| / max(|γ_i|, |γ_j|)",
            "abs_mean | rel_mean",
        ),
        _COMPONENT,
        Column("mean", "mean over heads of the measure", "≥ 0"),
        Column("std", "standard deviation over heads (ddof 0; the reference's band)", "≥ 0"),
        Column("median", "median over heads", "≥ 0"),
        Column("p<q>", "<q>th percentile over heads (the band drawn)", "≥ 0"),
        Column("n_heads", "heads (images × heads of the block)", "count"),
    ),
    {"q": r"\d+"},
)

_GAMMA = Schema(
    "Figure 3 records",
    "`results/figure3/gamma_<variant>.csv` (rule `gamma_vision`; metadata: rule `records_metadata`): one row per "
    "(image, head, eigenvectors, component)",
    (
        _SAMPLE_RANK,
        _HEAD,
        _EIGENVECTORS,
        _COMPONENT,
        Column("abs_mean", "mean over token pairs i < j of |γ_i − γ_j|, Γ = (K̃A) / (N A)", "≥ 0"),
        Column("abs_std", "standard deviation over token pairs of |γ_i − γ_j| (ddof 1)", "≥ 0"),
        Column("rel_mean", "mean over token pairs of |γ_i − γ_j| / (max(|γ_i|, |γ_j|) + 1e-10)", "≥ 0"),
        Column("rel_std", "standard deviation over token pairs of the relative spread (ddof 1)", "≥ 0"),
    ),
)

# --------------------------------------------------------------------------------------
# Tables 2 and 3 records (rule eigenvalues_vision)
# --------------------------------------------------------------------------------------

_SPECTRA = Schema(
    "Eigenvalue records",
    "`results/spectra/<variant>/<model>/{vision_<n>,user}_<shard>_{standardized,raw}.csv` (rules "
    "`eigenvalues_vision`, `eigenvalues_user`; "
    "metadata: rule `records_metadata`): one row per (image, layer, head), the records Tables 2 and 3 aggregate",
    (
        _MODEL_ID,
        _VARIANT,
        Column("keys", "the keys standardized per token, or raw", "standardized | raw"),
        _SAMPLE_RANK,
        _DATASET_INDEX,
        _LAYER,
        _HEAD,
        Column("finite", "every eigenvalue is finite", "bool"),
        Column(
            "lambda_<r>",
            "the <r>th largest |eigenvalue| of the centered Gram matrix (not divided by N); NaN where the paper "
            "variant overflows",
            "eigenvalue",
        ),
    ),
    {"r": r"\d+"},
)

# --------------------------------------------------------------------------------------
# Figures 1 and 4, the training claims, the token ablation (training.smk)
# --------------------------------------------------------------------------------------

_TRAINING_CURVES = Schema(
    "Figures 1 and 4: training curves",
    "`results/figure1.csv`, `results/figure4.csv` (rule `figure_training`): one row per plotted point "
    "(docs/method.md 6-7, docs/training.md)",
    (
        Column("source", "whose run: the authors' W&B logs or this pipeline's runs at a scale", "text"),
        Column("model", "the trained architecture (vit_tiny, deit_tiny)", "text"),
        Column(
            "split",
            "the fixed batch: train (a training batch, train mode) or test (the first validation batch, eval mode)",
            "train | test",
        ),
        Column(
            "metric",
            "error: J_proj = mean |‖φ(q_i)‖² − ‖h_i‖²|; h_norms_ave, phiq_norms_ave: the means of ‖h_i‖², ‖φ(q_i)‖²; "
            "error_median, h_norms_median, phiq_norms_median: medians over tokens; "
            "rel_error_wrt_h, rel_error_wrt_phiq: the relative errors (Figure 4)",
            "text",
        ),
        Column("epoch", "epoch, 0-based", "index"),
        Column(
            "x",
            "the x drawn: the epoch, or for the authors' logs W&B Step / 15 as they plot it (docs/method.md 6.2)",
            "epochs",
        ),
        Column("n_seeds", "seeds with a value at this point", "count"),
        Column("value", "median over seeds of the metric", "as the metric"),
        Column("value_min", "smallest value over seeds", "as the metric"),
        Column("value_max", "largest value over seeds", "as the metric"),
        Column("panel", "the panel: rel_h (top) or rel_phi (bottom)", "rel_h | rel_phi", "Figure 4"),
        Column("plotted", "the value as drawn (the median over seeds)", "as the metric", "Figure 4"),
    ),
)

_CLAIMS = Schema(
    "Training claims",
    "`results/training_claims.csv` (rule `training_claims`): in how many seeds and epochs each of the authors' "
    "Figure 1 observations holds (docs/training.md)",
    (
        Column("model", "the trained architecture", "text"),
        Column("scale", "the training scale (config training.scales)", "text"),
        Column("tokens", "N, tokens per image", "count"),
        Column("split", "the fixed batch the statistics are logged on", "train | test"),
        Column(
            "claim",
            "the observation (its words: `definition`)",
            "phiq_much_smaller_than_h | jproj_close_to_h | jproj_falls | jproj_falls_second_half",
        ),
        Column("statistic", "mean: as the authors log it; median: over the tokens of the batch", "mean | median"),
        Column(
            "scope",
            "what is counted: (seed, epoch) pairs, seeds at their last epoch, or whole runs (seeds)",
            "every epoch | last epoch | whole run",
        ),
        Column("holds", "pairs or seeds where the claim holds", "count"),
        Column("total", "pairs or seeds counted (0: the statistic is not logged)", "count"),
        Column("fraction", "holds / total; empty when total is 0", "fraction in [0, 1]"),
        Column("n_seeds", "seeds of the run", "count"),
        Column("definition", "the claim in words, with its thresholds (config figure1.claims)", "text"),
    ),
)

_WHEN = {"first": "the first epoch", "last": "the last epoch"}
_SPREAD = {
    "": "median over the run's seeds",
    "_min": "smallest value over the seeds",
    "_max": "largest value over the seeds",
}
_ABLATION_QUANTITY = {
    "j_proj": "J_proj (mean |‖φ(q_i)‖² − ‖h_i‖²|, as logged)",
    "j_proj_median": "median over tokens of |‖φ(q_i)‖² − ‖h_i‖²|",
    "h_norm_sq": "mean ‖h_i‖² (as logged)",
    "h_norm_sq_median": "median over tokens of ‖h_i‖²",
    "h_norm_sq_q99": "0.99 quantile over tokens of ‖h_i‖²",
    "phiq_norm_sq": "mean ‖φ(q_i)‖² (as logged)",
    "phiq_norm_sq_median": "median over tokens of ‖φ(q_i)‖²",
    "phiq_norm_sq_q99": "0.99 quantile over tokens of ‖φ(q_i)‖²",
    "phiq_above_h": "share of tokens with ‖φ(q_i)‖² > ‖h_i‖²",
}

_ABLATION = Schema(
    "Token ablation",
    "`results/token_ablation.csv` (rule `token_ablation`): one row per (model, scale, split) (docs/training.md, 'The "
    "ablation')",
    (
        Column("model", "the trained architecture", "text"),
        Column("scale", "the training scale (config training.scales)", "text"),
        Column("tokens", "N, tokens per image", "count"),
        Column("split", "the fixed batch the statistics are logged on", "train | test"),
        Column("epochs", "epochs logged per seed", "count"),
        Column("n_seeds", "seeds of the run", "count"),
        Column("seeds", "the seeds, space-separated", "text"),
        Column("train_loss_first", "training loss at the first epoch, median over seeds", "cross-entropy"),
        Column("train_loss_last", "training loss at the last epoch, median over seeds", "cross-entropy"),
        Column("test_acc1_last", "top-1 validation accuracy at the last epoch, median over seeds", "%"),
        Column("<quantity>_<when><spread>", "<quantity> at <when> on the split's batch: <spread>", "as the quantity"),
    ),
    {"quantity": _ABLATION_QUANTITY, "when": _WHEN, "spread": _SPREAD},
)

_DECODERS_PREFIX = Schema(
    "The decoders' prefix profile",
    "`results/decoders_prefix.csv` and `results/decoders_prefix_corrected.csv`: one row per (decoder, prefix "
    "length), Table 4's metrics "
    "of V[:P] against V_KPCA^(P) on each row's first P real tokens (docs/method.md 16)",
    (
        _MODEL,
        _HF_ID,
        _VARIANT,
        Column(
            "prefix",
            "the prefix length P (config decoders.prefix_lengths), or N: each row's full length (the decoders "
            "table's records)",
            "tokens, or N",
        ),
        Column("n_tokens", "mean token count of a head: P, or the mean row length at N", "tokens"),
        Column("n_rows", "rows with at least P real tokens (shorter rows are left out at P)", "count"),
        Column("n_heads", "heads analysed: rows × layers × KV heads", "count"),
        Column(
            "MDC",
            "mean over heads (NaN skipped) of the per-head maximum over tokens of the direct cosine of V[:P] and "
            "V_KPCA^(P)",
            _COSINE,
        ),
        Column(
            "MOC",
            "mean over heads (NaN skipped) of the per-head maximum over tokens of the optimal-matching cosine",
            _COSINE,
        ),
        Column("LCKA", "mean over heads (NaN skipped) of the linear CKA of V[:P] and V_KPCA^(P)", "[0, 1]"),
        Column("KCKA", "mean over heads (NaN skipped) of the RBF CKA of V[:P] and V_KPCA^(P)", "[0, 1]"),
        Column(
            "n_heads_nonfinite",
            "heads with a non-finite value in one of the four per-head columns, skipped by the means",
            "count",
        ),
        Column(
            "cka_all_directions_kept",
            "every head has P ≤ d + 1: its kept eigenvectors span the whole centered space, so LCKA and KCKA test "
            "only g "
            "and carry no kernel-PCA information (docs/method.md 17.1); such rows are left out of the figure's CKA "
            "lines",
            "bool",
        ),
        Column("n_heads_all_directions_kept", "heads with N ≤ d + 1", "count"),
        Column(
            "LCKA_unbiased",
            "mean over heads (NaN skipped) of the linear CKA with the unbiased HSIC estimator (docs/method.md 17.2)",
            "≤ 1",
            "corrected",
        ),
        Column(
            "KCKA_unbiased",
            "mean over heads (NaN skipped) of the RBF CKA with the unbiased HSIC estimator",
            "≤ 1",
            "corrected",
        ),
        *_PROJECTION_MEANS,
    ),
)

#: Every kind of results CSV, by name: what :func:`describe` and :func:`metadata` take.
SCHEMAS: dict[str, Schema] = {
    "per_head_table": _PER_HEAD_TABLE,
    "corrected_table": _CORRECTED_TABLE,
    "spectrum_table": _SPECTRUM_TABLE,
    "paper_comparison": _COMPARISON,
    "norms": _NORMS,
    "decoders_prefix": _DECODERS_PREFIX,
    "figure3": _FIGURE3,
    "training_curves": _TRAINING_CURVES,
    "training_claims": _CLAIMS,
    "token_ablation": _ABLATION,
    "heads": _HEADS,
    "spectra": _SPECTRA,
    "gamma": _GAMMA,
}


# --------------------------------------------------------------------------------------
# Lookup, metadata, page
# --------------------------------------------------------------------------------------


def _values(spec: dict[str, str] | str) -> str:
    """The regular expression of a placeholder's values (longest first, so no prefix shadows a value)."""
    if isinstance(spec, str):
        return spec
    return "|".join(re.escape(v) for v in sorted(spec, key=len, reverse=True))


def _match(column: Column, name: str, placeholders: dict) -> dict[str, str] | None:
    """The placeholder values with which ``column``'s name gives ``name``, or None."""
    parts = re.split(r"<(\w+)>", column.name)
    regex = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>{_values(placeholders[p])})" for i, p in enumerate(parts))
    m = re.fullmatch(regex, name)
    return None if m is None else m.groupdict()


def _fill(text: str, values: dict[str, str], placeholders: dict) -> str:
    def words(m):
        key = m.group(1)
        if key not in values:
            return m.group(0)
        spec = placeholders[key]
        return values[key] if isinstance(spec, str) else spec[values[key]]

    return re.sub(r"<(\w+)>", words, text)


def describe(names, schema: str, extra: tuple[Column, ...] = ()) -> list[dict[str, str]]:
    """The description of each column name.

    Args:
        names: column names, in file order.
        schema: a key of :data:`SCHEMAS`.
        extra: entries looked up before the schema's (:func:`statistic_columns` of a per-head table).

    Returns:
        Per name, in order: ``{"name", "description", "unit"}`` (placeholders filled in).

    Raises:
        KeyError: an unknown schema.
        UndescribedColumnError: a name no entry matches (all of them named).
    """
    entry = SCHEMAS[schema]
    out, missing = [], []
    for name in names:
        for column in (*extra, *entry.columns):
            values = _match(column, name, entry.placeholders)
            if values is not None:
                out.append(
                    {
                        "name": name,
                        "description": _fill(column.description, values, entry.placeholders),
                        "unit": _fill(column.unit, values, entry.placeholders),
                    }
                )
                break
        else:
            missing.append(name)
    if missing:
        raise UndescribedColumnError(
            f"column(s) {', '.join(missing)} of a {schema!r} CSV have no description: add an entry to "
            f"SCHEMAS[{schema!r}] in src/kpca_repro/analysis/columns.py (docs/columns.md)"
        )
    return out


def _datatype(dtype) -> str | dict:
    """The CSVW datatype of a pandas dtype: a boolean column is declared with the format of what
    pandas writes, ``True|False`` (CSVW's boolean format ``"<true>|<false>"``; its default lexical
    forms are true/false/1/0), so that the CSV's bytes stay as they are."""
    kind = getattr(dtype, "kind", "O")
    if kind == "b":
        return {"base": "boolean", "format": "True|False"}
    return {"i": "integer", "u": "integer", "f": "double"}.get(kind, "string")


def metadata(frame, schema: str, csv_name: str, title: str, extra: tuple[Column, ...] = ()) -> dict:
    """The CSVW metadata of one results CSV (W3C "Metadata Vocabulary for Tabular Data").

    Args:
        frame: the table as written (its columns and dtypes), a pandas DataFrame.
        schema: a key of :data:`SCHEMAS`.
        csv_name: the CSV's file name, relative to the metadata file (``table1.csv``).
        title: what the table is (``dc:title``).
        extra: as :func:`describe`.

    Returns:
        A JSON-ready dict: ``@context``, ``url``, ``dc:title``, ``dc:description`` (the schema's
        files), ``tableSchema.columns`` (per column in order: ``name``, ``titles``, ``datatype``,
        ``dc:description``, ``schema:unitText``).

    Raises:
        UndescribedColumnError: as :func:`describe`.
    """
    described = describe(list(frame.columns), schema, extra)
    columns = [
        {
            "name": d["name"],
            "titles": d["name"],
            "datatype": _datatype(frame[d["name"]].dtype),
            "dc:description": d["description"],
            "schema:unitText": d["unit"],
        }
        for d in described
    ]
    return {
        "@context": "http://www.w3.org/ns/csvw",
        "url": csv_name,
        "dc:title": title,
        "dc:description": f"{SCHEMAS[schema].title}: {SCHEMAS[schema].files}. Every column: docs/columns.md.",
        "tableSchema": {"columns": columns},
    }


def metadata_json(frame, schema: str, csv_name: str, title: str, extra: tuple[Column, ...] = ()) -> str:
    """:func:`metadata` as the text of ``<csv>-metadata.json`` (UTF-8, indented, one trailing newline)."""
    return json.dumps(metadata(frame, schema, csv_name, title, extra), indent=1, ensure_ascii=False) + "\n"


def _cell(text: str) -> str:
    """``text`` for a Markdown table cell: pipes escaped, ``<name>`` outside code spans as text, not as an HTML tag."""
    parts = re.split(r"(`[^`]*`)", text.replace("|", r"\|"))
    return "".join(p if p.startswith("`") else re.sub(r"<(\w+)>", r"&lt;\1&gt;", p) for p in parts)


def markdown_page(statistics: dict[str, tuple[tuple[str, str, str], ...]]) -> str:
    """docs/columns.md: every schema's files and columns, as Markdown.

    Args:
        statistics: per-head table name -> its ``statistics`` (``{t.name: t.statistics for t in
            TABLES.values() if t.row}``), whose columns are listed under the per-head tables.
    """
    lines = [
        "# Every column of the results",
        "",
        "[← README](../README.md) · [all pages](../README.md#documentation)",
        "",
        "Generated from the registry `src/kpca_repro/analysis/columns.py` by `python tools/columns_page.py > "
        "docs/columns.md`",
        "(`tests/test_columns.py` checks this page against it). Each CSV under `results/` has its columns,",
        "with their datatypes, in `<name>.csv-metadata.json` beside it (W3C CSVW: `dc:description`, `schema:unitText`;",
        "a boolean column's format is `True|False`, as the CSV holds it); `csvwvalidate` (the csvw package) accepts "
        "each.",
        "The job that writes a table or figure writes its metadata; the records of the method's jobs (`results/heads`,",
        "`results/spectra`, `results/figure3/gamma_*`) get theirs from the local rule `records_metadata`",
        "(`workflow/rules/metadata.smk`), built with the tables and figures that read them: those jobs import nothing",
        "of `analysis`, so that editing a description reruns that rule and none of them.",
        "The report's HTML tables show the descriptions under each table.",
        "`<...>` in a name stands for each of the values listed under the table.",
        "A new column (of a table's row function, say) needs an entry in the registry: without one, the job that "
        "writes",
        "the CSV stops before writing and names the column.",
    ]
    for key, schema in SCHEMAS.items():
        lines += ["", f"## {schema.title}", "", schema.files + ".", ""]
        columns = schema.columns
        if key == "per_head_table":
            names = {}
            for table, stats in statistics.items():
                for name, col, how in stats:
                    names.setdefault(name, []).append(f"{table}: {how} of `{col}`")
            lines += ["`<S>`: " + "; ".join(f"`{n}` ({', '.join(w)})" for n, w in names.items()) + ".", ""]
            generic = statistic_columns((("<S>", "<per-head column>", "max"),))
            columns = (
                Column(
                    "<S>",
                    "the statistic over heads (max, mean, or NaN-skipping mean) of its per-head column",
                    "as the per-head column",
                ),
                *generic[1:],
                *columns,
            )
        lines += ["| column | meaning | unit or range | only in |", "|---|---|---|---|"]
        lines += [f"| `{c.name}` | {_cell(c.description)} | {_cell(c.unit)} | {_cell(c.variants)} |" for c in columns]
        for name, spec in schema.placeholders.items():
            values = (
                f"`{spec}` (regular expression)"
                if isinstance(spec, str)
                else ", ".join(f"`{v}`" if v else "(empty)" for v in spec)
            )
            lines += ["", f"`<{name}>`: {values}."]
    return "\n".join(lines) + "\n"
