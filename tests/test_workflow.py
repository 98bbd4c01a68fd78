"""The Snakemake DAG end to end: tiny models, the report, real DeiT-Tiny weights. (Its bad
configurations are checked in tests/test_config_checks.py, without Snakemake.)"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import REPO, TINY_KWARGS, checkout_env, real_deit_tiny, run_snakemake

pytestmark = pytest.mark.integration


def _write_config(path, **overrides):
    cfg = {
        "offline": True,
        "vision": {"models": sorted(TINY_KWARGS), "n_images": 4, "batch_size": 3, "shards": 2, "model_kwargs": TINY_KWARGS},
        "kpca": {"heads_per_chunk": 8, "threads": 1},
        "spectra": {"n_images": 3, "n_components": 8},
        "figure3": {"model": "vit_tiny_patch16_224", "block": 1, "n_images": 1, "n_components": 8},
        "text": {"models": []},  # vision only (the language models have their own tests)
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def tiny_run(tiny_resources, tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    published = work / "published"  # a stand-in for the paper's tables: one row per tiny model id
    published.mkdir()
    rows = "".join(f"{m},{m},0.10,0.30,0.06,0.28\n" for m in sorted(TINY_KWARGS))
    (published / "table1_vision_similarity.csv").write_text("model,timm_id,MDC,MOC,LCKA,KCKA\n" + rows + "ViT-Large,vit_large_patch16_224,0.13,0.30,0.06,0.25\n")
    cfg = _write_config(work / "test.yaml", resources_dir=str(tiny_resources), comparison={"published_tables": str(published)})
    proc = run_snakemake(work, *TARGETS, "--configfile", str(cfg))
    return work, cfg, proc


TARGETS = (
    "results/table1.csv",
    "results/table1_corrected.csv",
    "results/table2.csv",
    "results/table3.csv",
    "results/table3_corrected.csv",
    "results/figure3.pdf",
    "results/figure3_corrected.pdf",
    "results/figure2.pdf",
    "results/figure2_corrected.pdf",
    "results/paper_comparison.csv",
    "results/html/table1.html",
    "results/html/table1_corrected.html",
)


def test_every_results_csv_has_its_column_metadata(tiny_run):
    """Each CSV the run wrote under results/, the per-model norms and the method's records (per-head,
    eigenvalue, gamma; rule records_metadata) included, has ``<name>.csv-metadata.json`` beside it
    (kpca_repro.analysis.columns): CSVW, naming that CSV and its header's columns in order, each described."""
    work, _, _ = tiny_run
    csvs = sorted((work / "results").rglob("*.csv"))
    assert {p.name for p in csvs} >= {"table1.csv", "table1_corrected.csv", "table2.csv", "table3_corrected.csv", "figure2.csv", "figure3_corrected.csv", "paper_comparison.csv", "gamma_paper.csv"}
    assert {p.relative_to(work / "results").parts[0] for p in csvs} >= {"norms", "heads", "spectra", "figure3"}
    for csv in csvs:
        meta = json.loads(csv.with_name(csv.name + "-metadata.json").read_text(encoding="utf-8"))
        assert meta["url"] == csv.name and meta["@context"] == "http://www.w3.org/ns/csvw"
        columns = meta["tableSchema"]["columns"]
        assert [c["name"] for c in columns] == list(pd.read_csv(csv, nrows=0).columns), csv.name
        assert all(c["dc:description"] and c["schema:unitText"] for c in columns), csv.name
    assert "title=" in (work / "results" / "html" / "table1.html").read_text()  # the descriptions in the report's page


def test_a_csvw_validator_accepts_every_metadata_file_of_the_run(tiny_run):
    """``csvwvalidate`` (the csvw package, the test extra) accepts every ``*.csv-metadata.json`` under
    results/ with its CSV: in-process for each file (kpca_tools.csvw_check), and the command itself
    for Table 1's (booleans written as ``True``/``False``)."""
    pytest.importorskip("csvw")
    import shutil

    from kpca_tools.csvw_check import results_problems

    work, _, _ = tiny_run
    assert results_problems(work / "results") == []
    cli = shutil.which("csvwvalidate") or str(Path(sys.executable).with_name("csvwvalidate"))
    proc = subprocess.run([cli, "-v", str(work / "results" / "table1.csv-metadata.json")], capture_output=True, text=True)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_table1_from_tiny_models(tiny_run, tiny_resources):
    work, _, _ = tiny_run
    table = pd.read_csv(work / "results" / "table1.csv")
    assert list(table["timm_id"]) == sorted(TINY_KWARGS)
    assert list(table.columns[:6]) == ["model", "timm_id", "MDC", "MOC", "LCKA", "KCKA"]
    assert (table["n_heads"] == 4 * 2 * 3).all() and (table["n_images"] == 4).all()
    assert (table["n_heads_analysed"] + table["n_heads_dropped"] == table["n_heads"]).all()
    for col in ("MDC", "MOC", "LCKA", "KCKA"):
        assert table[col].between(-1, 1).all()
    for model_id in TINY_KWARGS:
        weights = tiny_resources / "weights" / "timm" / f"{model_id}.safetensors"
        row = table[table["timm_id"] == model_id].iloc[0]
        assert row["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (work / "results" / "table1.md").read_text().startswith("| model")
    # the table is the paper's aggregation of the per-head records of both shards
    heads = pd.concat(pd.read_csv(f) for f in sorted((work / "results" / "heads" / "paper").rglob("*.csv")))
    first = heads[heads["model"] == sorted(TINY_KWARGS)[0]]
    assert table.loc[0, "MOC"] == pytest.approx(first["optimal_cos_mean"].max())
    assert table.loc[0, "LCKA"] == pytest.approx(first["linear_cka"].mean())
    assert sorted(first["sample_rank"].unique()) == [0, 1, 2, 3]


def test_temporary_activations_go_after_their_last_reader(tiny_resources, tmp_path):
    """keep_activations: false marks the activation files temp(): Table 1 is built from them and
    they are gone at the end of the run; the same run with the default keeps them."""
    for keep in (False, True):
        work = tmp_path / f"keep_{keep}"
        work.mkdir()
        cfg = _write_config(
            work / "test.yaml",
            resources_dir=str(tiny_resources),
            keep_activations=keep,
            vision={"models": ["vit_tiny_patch16_224"], "model_kwargs": {"vit_tiny_patch16_224": TINY_KWARGS["vit_tiny_patch16_224"]}},
        )
        run_snakemake(work, "results/table1.csv", "--configfile", str(cfg))
        assert len(pd.read_csv(work / "results" / "table1.csv")) == 1
        assert len(list((work / "results" / "activations").rglob("*.h5"))) == (2 if keep else 0)  # two shards


def test_device_auto_without_a_gpu_runs_models_side_by_side(tiny_run):
    """``device: auto`` (the default) declares the ``gpu`` resource only where there is a GPU: on
    this CPU machine the extraction jobs of the two tiny models (one core each) run at once on
    the two cores, which the default profile's ``gpu=1`` would have serialised."""
    import torch

    out = tiny_run[2].stdout + tiny_run[2].stderr
    running = peak = 0
    for start, end in re.findall(r"^\s*(?:local)?rule (\w+):|Finished jobid: \d+ \(Rule: (\w+)\)", out, re.M):
        running += (start == "extract_vision") - (end == "extract_vision")
        peak = max(peak, running)
    assert "gpu=1" not in out or torch.cuda.is_available()
    assert peak >= 2 or torch.cuda.is_available(), out[-3000:]


def test_corrected_table_from_tiny_models(tiny_run):
    work, _, _ = tiny_run
    table = pd.read_csv(work / "results" / "table1_corrected.csv")
    assert set(table["column"]) >= {"linear_cka", "rbf_cka", "optimal_abs_cos_columns", "projection_cos"}
    # 17 or 18 tokens of d = 64 (32): every head keeps every direction, so no CKA statistic is left
    # (docs/method.md 17.1), and each head's CKA is its all-components control's
    cka = table["column"].isin(["linear_cka", "rbf_cka", "linear_cka_unbiased", "rbf_cka_unbiased"])
    assert (table.loc[cka, "n_all_directions_kept"] == table.loc[cka, "n_heads"]).all()
    assert table.loc[cka, ["mean", "std", "baseline_mean", "control_mean"]].isna().all().all()
    for records in (work / "results" / "heads" / "corrected").glob("*/*.csv"):
        heads = pd.read_csv(records)
        assert heads["all_directions_kept"].all()
        np.testing.assert_allclose(heads["linear_cka"], heads["control_linear_cka"], rtol=1e-8)
    others = table[~cka]
    assert (others["n_nonfinite"] == 0).all() and (others["n_all_directions_kept"] == 0).all()
    assert np.isfinite(others[["mean", "std", "baseline_mean"]].to_numpy()).all()
    assert "random" in (work / "results" / "table1_corrected.md").read_text()


def test_spectra_tables_from_tiny_models(tiny_run):
    work, _, _ = tiny_run
    t2 = pd.read_csv(work / "results" / "table2.csv")
    t3 = pd.read_csv(work / "results" / "table3.csv")
    assert list(t2["timm_id"]) == sorted(TINY_KWARGS) and (t2["n_images"] == 3).all()
    assert (t2["n_heads"] == 3 * 2 * 3).all() and (t2["max_mean"] >= t2["median_mean"]).all()
    pd.testing.assert_series_equal(t2["max_mean"], t3["max_mean"])
    expected = (t3["mean_mean_raw"] / t3["mean_mean"] - 1) * 100
    np.testing.assert_allclose(t3["mean_change_pct"], expected)


def test_figure3_from_a_tiny_model(tiny_run):
    work, _, _ = tiny_run
    for suffix in ("", "_corrected"):
        assert (work / "results" / f"figure3{suffix}.pdf").read_bytes()[:4] == b"%PDF"
        assert (work / "results" / f"figure3{suffix}.png").stat().st_size > 10_000
        stats = pd.read_csv(work / "results" / f"figure3{suffix}.csv")
        assert set(stats["component"]) == set(range(8))
        mean = stats.groupby(["eigenvectors", "measure"])["mean"].mean()
        assert mean[("perturbed", "rel_mean")] > 100 * mean[("true", "rel_mean")]
        # the band is the 25th-75th percentile over the 3 heads: inside [min, max] of a non-negative spread
        assert (stats["n_heads"] == 3).all() and (0 <= stats["p25"]).all()
        assert (stats["p25"] <= stats["median"]).all() and (stats["median"] <= stats["p75"]).all()


def test_figure2_from_tiny_models(tiny_run):
    """Paper: the k = 1 draw, s = 1/8; corrected: all images of both shards, the file's own head_dim."""
    work, _, _ = tiny_run
    tokens = {"vit_tiny_patch16_224": 17, "deit_tiny_distilled_patch16_224": 18}
    head_dim = {"vit_tiny_patch16_224": 64, "deit_tiny_distilled_patch16_224": 32}
    for suffix, n_images in (("", 1), ("_corrected", 4)):
        assert (work / "results" / f"figure2{suffix}.pdf").read_bytes()[:4] == b"%PDF"
        assert (work / "results" / f"figure2{suffix}.png").stat().st_size > 10_000
        stats = pd.read_csv(work / "results" / f"figure2{suffix}.csv")
        assert list(dict.fromkeys(stats["model"])) == sorted(TINY_KWARGS) and len(stats) == 2 * 2 * 2
        for model, df in stats.groupby("model"):
            assert (df["n_values"] == n_images * 3 * tokens[model]).all() and (df["head_dim"] == head_dim[model]).all()
            assert np.allclose(df["scale"], 1 / 8 if not suffix else head_dim[model] ** -0.5)
        assert (stats["band_lower"] <= stats["median"]).all() and (stats["median"] <= stats["band_upper"]).all()
        assert (stats["n_kept"] < stats["n_values"]).all() if not suffix else (stats["n_kept"] == stats["n_values"]).all()


def test_interval_columns_on_the_tiny_run(tiny_run):
    """Solver, combined and bootstrap intervals beside the statistics they bound (docs/uncertainty.md)."""
    work, _, _ = tiny_run
    table = pd.read_csv(work / "results" / "table1.csv")
    cols = list(table.columns)
    assert cols[:6] == ["model", "timm_id", "MDC", "MOC", "LCKA", "KCKA"]
    # after KCKA, per statistic: MDC and MOC their solver (signs and rotations) then combined interval, LCKA and KCKA their bootstrap interval
    intervals = [
        "MDC_solver_lower", "MDC_solver_upper", "MDC_lower", "MDC_upper",
        "MOC_solver_lower", "MOC_solver_upper", "MOC_lower", "MOC_upper",
        "LCKA_lower", "LCKA_upper", "KCKA_lower", "KCKA_upper",
    ]  # fmt: skip
    assert cols[6 : 6 + len(intervals)] == intervals
    assert np.isfinite(table[intervals].to_numpy(float)).all()  # every interval computed, no NaN bound
    for stat in ("MDC", "MOC", "LCKA", "KCKA"):
        assert (table[f"{stat}_lower"] <= table[f"{stat}_upper"]).all()
    for stat in ("MDC", "MOC"):
        assert (table[f"{stat}_solver_lower"] <= table[f"{stat}_solver_upper"]).all()
        assert table[[f"{stat}_solver_lower", f"{stat}_solver_upper", f"{stat}_lower", f"{stat}_upper"]].abs().le(1).all().all()
    # a mean over heads: its bootstrap interval holds the value (up to round-off)
    for stat in ("LCKA", "KCKA"):
        assert (table[f"{stat}_lower"] <= table[stat] + 1e-12).all() and (table[stat] <= table[f"{stat}_upper"] + 1e-12).all()
    assert (table["sign_draws"] > 0).all() and (table["sign_draws_optimal"] > 0).all() and (table["bootstrap_resamples"] >= 10).all()
    # the stored draws: one row per head record, one file per records file
    for csv in (work / "results" / "heads" / "paper").rglob("*.csv"):
        import h5py

        with h5py.File(str(csv).replace(".csv", "_signs.h5")) as f:
            n = len(pd.read_csv(csv))
            assert f["direct_cos_mean"].shape == (n, table["sign_draws"].iloc[0]) and f["optimal_cos_mean"].shape[0] == n
    for name in ("table2", "table3"):
        spectra = pd.read_csv(work / "results" / f"{name}.csv")
        for cell in [f"{s}_{m}" for s in ("max", "min", "mean", "median") for m in ("mean", "std")] + ([f"{s}_mean_raw" for s in ("max", "min")] if name == "table3" else []):
            assert (spectra[f"{cell}_lower"] <= spectra[f"{cell}_upper"]).all(), cell
            if cell.endswith("_mean") or cell.endswith("_mean_raw"):
                assert (spectra[f"{cell}_lower"] <= spectra[cell] + 1e-9).all() and (spectra[cell] <= spectra[f"{cell}_upper"] + 1e-9).all()


def test_second_run_does_nothing(tiny_run):
    work, cfg, _ = tiny_run
    proc = run_snakemake(work, "-n", *TARGETS, "--configfile", str(cfg))
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_comparison_and_report(tiny_run, tmp_path):
    work, cfg, _ = tiny_run
    comparison = pd.read_csv(work / "results" / "paper_comparison.csv")
    table1 = pd.read_csv(work / "results" / "table1.csv").set_index("timm_id")
    assert len(comparison) == 3 * 4  # every published cell has a row
    for _, row in comparison[comparison["model_id"].isin(TINY_KWARGS)].iterrows():
        assert row["reproduced"] == pytest.approx(table1.loc[row["model_id"], row["column"]])
        assert row["difference"] == pytest.approx(row["reproduced"] - row["published"])
        assert (row["lower"], row["upper"]) == pytest.approx((table1.loc[row["model_id"], f"{row['column']}_lower"], table1.loc[row["model_id"], f"{row['column']}_upper"]))
        # the tiny models are built with vision.model_kwargs: not the published architecture
        assert row["status"] == "not comparable" and "model_kwargs" in row["reason"]
    large = comparison[comparison["model_id"] == "vit_large_patch16_224"]
    assert (large["status"] == "not run").all()
    assert large["reason"].str.startswith("not in config vision.models; weights unavailable").all()
    assert list(comparison["status"]) == ["not comparable"] * 8 + ["not run"] * 4  # rows that ran first
    assert "<table" in (work / "results" / "html" / "table1.html").read_text()
    report = tmp_path / "report.html"
    run_snakemake(work, *TARGETS, "--configfile", str(cfg), "--report", str(report))
    from kpca_tools.report_check import report_results

    shown = report_results(report)  # every table's page and figure of the targets, the comparison and the tables it reads
    pages = {f"results/html/{t}{s}.html" for t in ("table1", "table2", "table3") for s in ("", "_corrected")} | {"results/html/paper_comparison.html"}
    assert set(shown) == pages | {f"results/figure{f}{s}.png" for f in (2, 3) for s in ("", "_corrected")}, sorted(shown)


def test_report_reads_cleanly(tiny_run, tmp_path):
    """No docutils message anywhere in the built report; the front page describes this run's config."""
    from kpca_tools.report_check import front_page, markdown_problems, report_problems

    work, cfg, _ = tiny_run
    for md in sorted((work / "results").glob("*.md")):  # every Markdown table: one cell per column in every row
        assert markdown_problems(md.read_text()) == [], md.name
    report = tmp_path / "report.html"
    run_snakemake(work, *TARGETS, "--configfile", str(cfg), "--report", str(report))
    assert report_problems(report) == []
    page = front_page(report)
    for model_id, kwargs in TINY_KWARGS.items():
        assert f'<tt class="docutils literal">{model_id}</tt>' in page
        assert f"depth={kwargs['depth']}" in page  # the changed architectures are said
    assert "vit_large_patch16_224" not in page and "bert-base-uncased" not in page  # not the default models
    assert "4 images per model in 2 shard(s)" in page and "Table 4" not in page and "Figure 5" not in page  # what the run built, only


def test_the_report_in_a_browser_shows_its_top_and_table1s_intervals(tiny_run, tmp_path):
    """The built report in headless Chromium at 1600x1000 (kpca_tools.report_browser), scrolled to
    the top: the landing page's first heading and "What this run built" inside the window; Table
    1's page shows MDC with its interval in one cell, as table1.md does, inside the window."""
    from kpca_tools import report_browser
    from kpca_tools.report_check import report_results

    if report_browser.chromium() is None:
        pytest.skip("no Chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)")
    work, cfg, _ = tiny_run
    report = tmp_path / "report.html"
    run_snakemake(work, *TARGETS, "--configfile", str(cfg), "--report", str(report))
    view = report_browser.landing_view(report)
    assert view["innerWidth"] == 1600 and 800 < view["innerHeight"] <= 1000  # the window less the browser's own bars
    assert view["heading"]["text"].startswith("The kernel PCA interpretation of self-attention") and report_browser.in_viewport(view["heading"], view), view
    assert report_browser.in_viewport(view["built"], view), view
    page = report_results(report)["results/html/table1.html"]["content"].decode()
    table = report_browser.table_view(page, "MDC")
    mdc = table["cell"]["text"]
    assert re.fullmatch(r"-?\d\.\d{3} \[-?\d\.\d{3}, -?\d\.\d{3}\]", mdc) and report_browser.in_viewport(table["cell"], table), table
    md_row = (work / "results" / "table1.md").read_text().splitlines()[2]
    assert mdc in [cell.strip() for cell in md_row.split("|")]  # the cell of table1.md


def test_report_fails_on_a_docutils_error(tiny_run, tmp_path):
    """A caption with an undefined |substitution| stops `snakemake --report` (workflow/report/docutils.conf)."""
    import shutil

    work, cfg, _ = tiny_run
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "results", ".snakemake", "tests", "docs", "perf", "__pycache__"))
    caption = copy / "workflow" / "report" / "figure3.rst"
    caption.write_text(caption.read_text() + "\nThe spread |γᵢ − γⱼ| again.\n")
    cmd = [sys.executable, "-m", "snakemake", "-s", str(copy / "Snakefile"), "-d", str(work), "--cores", "1"]
    proc = subprocess.run([*cmd, "results/figure3.pdf", "--configfile", str(cfg), "--report", str(tmp_path / "r.html")], capture_output=True, text=True, cwd=work, env=checkout_env(copy))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not (tmp_path / "r.html").exists()
    assert 'Undefined substitution referenced: "γᵢ − γⱼ"' in out and "figure3.rst" in out, out[-3000:]


#: docs/internals.md's recipe "A table": an entry of the table registry and its row function,
#: appended to src/kpca_repro/analysis/tables.py (the recipe adds the entry to TABLES' literal).
TOY_TABLE = '''

def table9_row(heads, kept, meta):
    """Table 9's columns after its statistic, for one model: its head count and weights."""
    return {"n_heads": len(heads), "weights_sha256": meta["weights_sha256"]}


TABLES["table9"] = Table(
    "table9",
    "vision",
    table9_row,
    (("MLC", "linear_cka", "mean"),),
    drops=True,
    corrected=tuple(m for m in CORRECTED_METRICS if m[0] in ("linear_cka", "rbf_cka")),
    published="table9_toy.csv",
    caption="**Table 9: a toy table.** The mean linear CKA over the kept heads.",
)
'''


def test_a_new_table_is_one_entry_and_one_function(tiny_run, tmp_path):
    """The recipe run: in a copy of the workflow, a toy table's entry and function in tables.py and its
    published numbers are all it takes for the one rule ``table`` to build it in both variants,
    its report pages too (their captions render cleanly), and the comparison to set it
    beside its published numbers. In a copy of the tiny run (times kept): no extraction or KPCA reruns."""
    import shutil

    work, cfg, _ = tiny_run
    copy, run = tmp_path / "repo", tmp_path / "work"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "results", ".snakemake", "tests", "docs", "perf", "__pycache__"))
    shutil.copytree(work, run, symlinks=True)
    tables_py = copy / "src" / "kpca_repro" / "analysis" / "tables.py"
    tables_py.write_text(tables_py.read_text() + TOY_TABLE)
    rows = "".join(f"{m},{m},0.10\n" for m in sorted(TINY_KWARGS))
    (run / "published" / "table9_toy.csv").write_text("model,timm_id,MLC\n" + rows + "ViT-Large,vit_large_patch16_224,0.06\n")
    overlay = run / "toy.yaml"
    overlay.write_text(yaml.safe_dump({"comparison": {"published_tables": str(run / "published")}}))
    targets = ["results/table9.csv", "results/table9_corrected.csv", "results/html/table9.html", "results/html/table9_corrected.html", "results/paper_comparison.csv"]
    cmd = [sys.executable, "-m", "snakemake", "-s", str(copy / "Snakefile"), "-d", str(run), "--cores", "2", *targets, "--rerun-triggers", "mtime"]
    proc = subprocess.run([*cmd, "--configfile", str(cfg), str(overlay)], capture_output=True, text=True, cwd=run, env=checkout_env(copy))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    planned = set(re.findall(r"^\s*(?:local)?rule (\w+):", out, re.M))
    assert planned == {"table", "paper_comparison"}, planned  # tables.py changed: the tables rerun, nothing upstream
    assert (run / "logs" / "table" / "table9_corrected.log").is_file()
    toy, table1 = (pd.read_csv(run / "results" / f"{t}.csv").set_index("timm_id") for t in ("table9", "table1"))
    assert list(toy.columns[:4]) == ["model", "MLC", "MLC_lower", "MLC_upper"]
    assert (toy["MLC"] == table1.loc[toy.index, "LCKA"]).all()  # the same statistic as Table 1's LCKA, bit for bit
    corrected = pd.read_csv(run / "results" / "table9_corrected.csv")
    assert set(corrected["column"]) == {"linear_cka", "rbf_cka"} and "| model" in (run / "results" / "table9_corrected.md").read_text()
    assert "<table" in (run / "results" / "html" / "table9.html").read_text()
    comparison = pd.read_csv(run / "results" / "paper_comparison.csv")
    toy_rows = comparison[comparison["table"] == "Table 9"].set_index("model_id")
    assert set(toy_rows.index) == {*TINY_KWARGS, "vit_large_patch16_224"} and (toy_rows["column"] == "MLC").all()
    assert (toy_rows.loc[sorted(TINY_KWARGS), "status"] == "not comparable").all() and toy_rows.loc["vit_large_patch16_224", "status"] == "not run"
    # the corrected table's linear_cka row (NaN here: every tiny head keeps every direction, docs/method.md 17.1)
    lcka = corrected[corrected["column"] == "linear_cka"].set_index("timm_id")["paper_statistic_value"]
    np.testing.assert_array_equal(toy_rows.loc[sorted(TINY_KWARGS), "corrected"].to_numpy(float), lcka.loc[sorted(TINY_KWARGS)].to_numpy(float))
    env = checkout_env(copy)
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tools")  # kpca_tools: the test tools, not installed
    lint = subprocess.run([sys.executable, "-m", "kpca_tools.report_check", "--root", str(copy), str(cfg)], capture_output=True, text=True, env=env)
    assert lint.returncode == 0, lint.stderr


def test_a_dry_run_imports_no_model_library(tiny_resources, tmp_path):
    """Building the DAG of Table 1 (configuration check, input, params and resources functions, code
    hashes) imports none of torch, timm or transformers: the checks that need them run in the jobs."""
    cfg = _write_config(tmp_path / "tiny.yaml", resources_dir=str(tiny_resources))
    cmd = [sys.executable, "-X", "importtime", "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n", "results/table1.csv", "--configfile", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=checkout_env())
    assert proc.returncode == 0 and "kpca_heads" in proc.stdout, proc.stderr[-3000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "kpca_repro.workflow.code" in imported
    assert not {m for m in imported if m.split(".")[0] in ("torch", "timm", "transformers")}


def test_input_and_params_functions_have_no_side_effects():
    """The functions of the rule files print nothing, exit nothing and register nothing but the notes of
    ``in_dag`` (common.smk: which jobs Snakemake placed, for the onstart handler): only the parse-time
    checkout and configuration checks and the onstart handler may end the run or set anything."""
    import ast

    allowed = {"_check_package_checkout", "_checked_config", "before_first_job"}
    found = []
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        lines = smk.read_text().splitlines()
        for i, line in enumerate(lines):
            if m := re.match(r"def (\w+)\(", line):
                end = next((j for j in range(i + 1, len(lines)) if lines[j] and not lines[j].startswith((" ", "#", ")"))), len(lines))
                body = "\n".join(lines[i:end])
                calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Call)}
                if m.group(1) not in allowed and (calls & {"print", "sys.exit", "exit", "os._exit"} or "os.environ[" in body):
                    found.append(f"{smk.name}: {m.group(1)}")
    assert not found, found
    assert not re.search(r"PREFLIGHT|on_cluster|print\(", "".join(p.read_text() for p in (REPO / "workflow" / "rules").glob("*.smk")))


def test_a_model_timm_does_not_know_fails_its_extraction_job_in_one_line(tiny_resources, tmp_path):
    """The model check needs timm, so it runs in the job that loads the model: the extraction of a model
    id timm does not know (weights present, so no download) ends in one ERROR line naming it."""
    res = tmp_path / "res"
    (res / "weights" / "timm").mkdir(parents=True)
    (res / "images").symlink_to(tiny_resources / "images")
    (res / "weights" / "timm" / "not_a_model_xyz.safetensors").symlink_to(tiny_resources / "weights" / "timm" / "vit_tiny_patch16_224.safetensors")
    cfg = _write_config(tmp_path / "bad.yaml", resources_dir=str(res), vision={"models": ["not_a_model_xyz"], "model_kwargs": {}, "shards": 1})
    proc = run_snakemake(tmp_path, "results/activations/not_a_model_xyz/vision_4_0of1.h5", "--configfile", str(cfg), check=False)
    assert proc.returncode != 0
    log = (tmp_path / "logs" / "extract_vision" / "not_a_model_xyz" / "vision_4_0of1.log").read_text()
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith("'not_a_model_xyz' is not a timm model id (see timm.list_models())"), log
    assert "Traceback" not in log and not (tmp_path / "results" / "activations" / "not_a_model_xyz").exists()


def test_lint_is_clean():
    proc = run_snakemake(REPO, "--lint", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


@pytest.mark.realweights
def test_real_deit_tiny_through_the_chain(tmp_path):
    """DeiT-Tiny's real weights and real ImageNet images from the resources directory."""
    res, weights, _ = real_deit_tiny()
    cfg = _write_config(
        tmp_path / "real.yaml",
        resources_dir=str(res),
        vision={"models": ["deit_tiny_patch16_224"], "n_images": 3, "batch_size": 3, "shards": 1, "model_kwargs": {}},
        kpca={"heads_per_chunk": 36, "threads": 2},
    )
    run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg))
    table = pd.read_csv(tmp_path / "results" / "table1.csv")
    row = table.iloc[0]
    assert row["model"] == "DeiT-Tiny" and row["n_heads"] == 3 * 12 * 3
    assert row["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert row["n_allclose"] == 0  # V is never V_KPCA (paper: 0 passes)
    assert 0 < row["LCKA"] < 1 and 0 < row["KCKA"] < 1 and row["MOC"] > row["MDC"]
    samples = pd.read_csv(tmp_path / "results" / "samples" / "vision_3.tsv", sep="\t")
    assert samples["path"].str.endswith("n04461696_tow_truck.JPEG").iloc[0]  # docs/method.md: seed 0 -> index 864
    meta = json.loads((tmp_path / "results" / "heads" / "paper" / "deit_tiny_patch16_224" / "vision_3_0of1.json").read_text())
    assert meta["n_images"] == 3
