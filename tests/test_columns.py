"""Every column of every results CSV has a description (kpca_repro.analysis.columns), the CSVW
metadata beside a CSV says what its columns are, docs/columns.md is the registry's page, and
the report's HTML tables keep significant digits.

The CSVs are built in-process as their jobs build them, by the same functions, from small
synthetic activation files and training logs: no Snakemake run.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from kpca_repro.activations import write_activations
from kpca_repro.analysis import columns, comparison, tables
from kpca_repro.analysis.report import format_number, table_html

from conftest import REPO

SETTINGS = {"seed": 0, "bootstrap": 20, "coverage": 0.95, "sign_coverage": 0.999}
VISION, TEXT = "synthetic/vit", "synthetic/lm"


def _activations(path, model_id, text=False, inputs=3, layers=2, heads=2, n=6, d=4, seed=0):
    """A small activation file of random q, k, v, h (language-model form with an attention mask when ``text``)."""
    rng = np.random.default_rng(seed)
    data = [{name: rng.normal(0, 1.5, (inputs, heads, n, d)).astype(np.float32) for name in ("q", "k", "v", "h")} for _ in range(layers)]
    mask = np.array([[1] * (n - i) + [0] * i for i in range(inputs)]) if text else None
    write_activations(path, data, model_id=model_id, attention_mask=mask, attrs={"weights_sha256": "ab" * 32}, check_invariant=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("columns")
    return {"vision": _activations(root / "vision.h5", VISION), "text": _activations(root / "text.h5", TEXT, text=True), "root": root}


@pytest.fixture(scope="module")
def heads(files):
    """Per-head records, metadata and solver draws: ``{(domain, variant): (records, meta, draws)}``, as rule kpca_heads makes them."""
    from kpca_repro.method.records import KpcaJob, kpca_records

    out = {}
    for domain in ("vision", "text"):
        for variant in ("paper", "corrected"):
            job = KpcaJob(variant, seed=0, sign_draws=(8, 2) if variant == "paper" else (0, 0))
            records, meta, draws = kpca_records(files[domain], job)
            out[(domain, variant)] = (records, meta, draws if job.draws_wanted else None)
    return out


def _per_head_table(name, variant, heads):
    """Table 1 or 4 in one variant, as rule table builds it, with the schema that describes it."""
    table = tables.TABLES[name]
    records, meta, draws = heads[(table.domain, variant)]
    records = records.reset_index(drop=True)
    by_model = {meta["model_id"]: meta}
    frame = tables.paper_table(table, records, by_model, draws, SETTINGS) if variant == "paper" else tables.table_corrected(records, by_model, table)
    return frame, tables.column_schema(table, variant == "paper")


def _spectrum_table(name, variant, files):
    from kpca_repro.method.records import eigenvalue_records

    table = tables.TABLES[name]
    frames = {(VISION, keys): eigenvalue_records(files["vision"], variant, keys == "standardized", n_components=3) for keys in table.keys}
    frame = tables.table_spectra(frames, SETTINGS)
    frame.insert(2, "variant", variant)
    return frame, frames


def _described(frame, schema, extra=()):
    """Every column of ``frame`` has a non-empty description and unit (describe raises on a missing one)."""
    described = columns.describe(list(frame.columns), schema, extra)
    assert [d["name"] for d in described] == list(frame.columns)
    # no placeholder left unfilled (a name in a code span, `baseline_<column>`, is a pattern the text refers to)
    assert all(d["description"] and d["unit"] and not re.search(r"<\w+>", re.sub(r"`[^`]*`", "", d["description"] + d["unit"])) for d in described), described
    return described


@pytest.mark.parametrize("name", ["table1", "table4"])
@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_every_column_of_tables_1_and_4_is_described(name, variant, heads):
    frame, (schema, extra) = _per_head_table(name, variant, heads)
    described = {d["name"]: d for d in _described(frame, schema, extra)}
    if variant == "paper":  # the columns of issue 56, each named in its description
        assert "MDC_lower" in frame and "n_exp_overflow" in frame
        statistic = "maximum" if name == "table1" else "mean over every head"
        assert statistic in described["MDC"]["description"] and ("direct_cos_mean" if name == "table1" else "direct_cos_max") in described["MDC"]["description"]


@pytest.mark.parametrize("name", ["table2", "table3"])
@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_every_column_of_tables_2_and_3_and_their_records_is_described(name, variant, files):
    frame, records = _spectrum_table(name, variant, files)
    described = {d["name"]: d for d in _described(frame, *tables.column_schema(tables.TABLES[name], variant == "paper"))}
    assert "largest" in described["max_mean"]["description"] and "standard deviation" in described["max_std"]["description"]
    for r in records.values():
        _described(r, "spectra")


def test_every_column_of_the_records_and_the_comparison_is_described(heads, files, tmp_path):
    for records, _, _ in heads.values():
        _described(records, "heads")
    results = {}
    for name in ("table1", "table2", "table3", "table4"):
        pair = []
        for variant in ("paper", "corrected"):
            frame = _per_head_table(name, variant, heads)[0] if name in ("table1", "table4") else _spectrum_table(name, variant, files)[0]
            path = tmp_path / f"{name}_{variant}.csv"
            frame.to_csv(path, index=False)
            pair.append(str(path))
        results[name] = tuple(pair)
    table = comparison.comparison_table(comparison.BUILTIN, results, {})
    assert len(table) > 100
    _described(table, "paper_comparison")


@pytest.mark.parametrize("variant", ["paper", "corrected"])
def test_every_column_of_figures_2_3_and_5_is_described(variant, files, tmp_path):
    from kpca_repro.analysis.norms import norm_statistics
    from kpca_repro.figures.plots import plot_gamma
    from kpca_repro.method.records import gamma_records

    for domain in ("vision", "text"):
        _described(norm_statistics([files[domain]], variant, language=domain == "text", progress=False), "norms")
    gamma = gamma_records(files["vision"], 1, variant, standardize=True, noise=0.1, seed=0, n_components=3)
    _described(gamma, "gamma")
    _described(plot_gamma(gamma, tmp_path / "f3.pdf", tmp_path / "f3.png", "title"), "figure3")


def test_every_column_of_the_training_results_is_described(tmp_path):
    from kpca_repro.training.figures import plot_figure1, plot_figure4
    from kpca_repro.training.logs import LOG_COLUMNS, training_curves, write_training_log
    from kpca_repro.training.summary import token_ablation_table, training_claims

    rng = np.random.default_rng(0)
    runs = []
    for seed in (0, 1):
        path = tmp_path / f"seed{seed}" / "log.csv"
        path.parent.mkdir()
        write_training_log([{c: float(e) if c == "epoch" else float(rng.uniform(0.1, 2)) for c in LOG_COLUMNS} for e in range(4)], path)
        runs.append((path, "vit_tiny", "small", 17, seed))
    _described(training_claims(runs), "training_claims")
    _described(token_ablation_table(runs), "token_ablation")
    curves = training_curves([(path, model, "this pipeline (small)", seed) for path, model, _, _, seed in runs], None)
    _described(plot_figure1(curves, tmp_path / "f1.pdf", tmp_path / "f1.png", {}), "training_curves")
    _described(plot_figure4(curves, tmp_path / "f4.pdf", tmp_path / "f4.png", {}), "training_curves")


def test_a_column_without_description_stops_the_job():
    with pytest.raises(columns.UndescribedColumnError, match=r"column\(s\) new_statistic, other of a 'norms' CSV .*columns\.py"):
        columns.describe(["model", "new_statistic", "median", "other"], "norms")
    with pytest.raises(ValueError, match="unknown aggregation"):
        columns.statistic_columns((("X", "linear_cka", "median"),))


def test_the_metadata_beside_table1(heads, tmp_path):
    """The sidecar of results/table1.csv: CSVW, the CSV's columns in order with datatype, meaning and unit."""
    frame, (schema, extra) = _per_head_table("table1", "paper", heads)
    text = columns.metadata_json(frame, schema, "table1.csv", "Table 1, paper variant", extra)
    meta = json.loads(text)
    assert meta["@context"] == "http://www.w3.org/ns/csvw" and meta["url"] == "table1.csv" and meta["dc:title"] == "Table 1, paper variant"
    cols = {c["name"]: c for c in meta["tableSchema"]["columns"]}
    assert [c["name"] for c in meta["tableSchema"]["columns"]] == list(frame.columns) and all(c["titles"] == c["name"] for c in cols.values())
    types = {"MDC": "double", "n_heads": "integer", "weights_sha256": "string", "solver_rotations": {"base": "boolean", "format": "True|False"}}
    assert {n: cols[n]["datatype"] for n in types} == types
    assert "eigengap_min" in cols["MDC_eigengap"]["dc:description"]
    assert cols["MDC"]["schema:unitText"] == "cosine in [-1, 1]"
    assert "drops" in cols["n_heads_dropped"]["dc:description"] and "overflows float32" in cols["n_outer_overflow"]["dc:description"]
    # the report's page of that CSV: every header has its description as a tooltip, and a legend
    frame.to_csv(tmp_path / "table1.csv", index=False)
    (tmp_path / "table1.csv-metadata.json").write_text(text)
    page = table_html(tmp_path / "table1.csv", "table1", tmp_path / "table1.csv-metadata.json")
    assert page.count("<th title=") == len(frame.columns) and page.count("<dt>") == len(frame.columns)
    assert f"<td>{format_number(frame.loc[0, 'MDC_eigengap'])}</td>" in page


def test_a_csvw_validator_accepts_each_kind_of_csv_with_its_metadata(heads, files, tmp_path):
    """Each kind of results CSV, written as its job writes it (pandas' ``to_csv``: ``True``/``False``,
    empty cells for NaN, ``inf``), with the metadata :func:`columns.metadata_json` gives it: what
    ``csvwvalidate`` checks (kpca_tools.csvw_check) passes, the boolean columns included; the same
    table with CSVW's default boolean datatype is refused, so the check reads the cells."""
    pytest.importorskip("csvw")
    from kpca_repro.analysis.norms import norm_statistics
    from kpca_repro.method.records import gamma_records
    from kpca_tools.csvw_check import metadata_problems

    frames = {}
    for name in ("table1", "table4"):
        for variant in ("paper", "corrected"):
            frame, (schema, extra) = _per_head_table(name, variant, heads)
            frames[f"{name}_{variant}"] = (frame, schema, extra)
    for name in ("table2", "table3"):
        frame, records = _spectrum_table(name, "paper", files)
        frames[name] = (frame, *tables.column_schema(tables.TABLES[name], True))
        frames[f"{name}_spectra"] = (next(iter(records.values())), "spectra", ())
    for (domain, variant), (records, _, _) in heads.items():
        frames[f"heads_{domain}_{variant}"] = (records, "heads", ())
    for domain in ("vision", "text"):
        frames[f"norms_{domain}"] = (norm_statistics([files[domain]], "paper", language=domain == "text", progress=False), "norms", ())
    frames["gamma"] = (gamma_records(files["vision"], 1, "paper", standardize=True, noise=0.1, seed=0, n_components=3), "gamma", ())
    assert frames["table1_paper"][0]["solver_rotations"].dtype == bool and frames["heads_vision_paper"][0]["dropped"].dtype == bool
    for name, (frame, schema, extra) in frames.items():
        frame.to_csv(tmp_path / f"{name}.csv", index=False)
        (tmp_path / f"{name}.csv-metadata.json").write_text(columns.metadata_json(frame, schema, f"{name}.csv", name, extra))
        assert metadata_problems(tmp_path / f"{name}.csv-metadata.json") == [], name
    meta = json.loads((tmp_path / "table1_paper.csv-metadata.json").read_text())
    for column in meta["tableSchema"]["columns"]:
        if isinstance(column["datatype"], dict):
            column["datatype"] = "boolean"
    (tmp_path / "table1_paper.csv-metadata.json").write_text(json.dumps(meta))
    assert "invalid lexical value for boolean: True" in " ".join(metadata_problems(tmp_path / "table1_paper.csv-metadata.json"))


@pytest.mark.parametrize(
    "value, text",
    [
        (8.376569293659996e-07, "8.38e-07"),  # MDC_eigengap, 0.000 before
        (0.00021240402255718512, "0.000212"),  # MDC_mean_over_heads, 0.000 before
        (0.14393460750579834, "0.144"),
        (6.497331872509593, "6.50"),
        (326.7990801638613, "327"),
        (999.7, "1000"),
        (1104.5250912317783, "1105"),
        (6.785025046796575e33, "6.79e+33"),
        (-0.0011772654443827912, "-0.00118"),
        (100.0, "100"),
        (0.0, "0"),
        (math.nan, ""),
        (np.float32(0.95), "0.950"),
        (3600, "3600"),
        (np.int64(-1), "-1"),
        (True, "True"),
        ("within rounding", "within rounding"),
    ],
)
def test_report_numbers_keep_three_significant_digits(value, text):
    assert format_number(value) == text


def test_docs_page_is_the_registrys():
    """docs/columns.md is what tools/columns_page.py writes: regenerate it after editing the registry."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("columns_page", REPO / "tools" / "columns_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs" / "columns.md").read_text(encoding="utf-8") == module.page(), "run: python tools/columns_page.py > docs/columns.md"
    for key, schema in columns.SCHEMAS.items():
        assert f"## {schema.title}" in module.page(), key
