"""kpca_repro.workflow.paths: the workflow's file layout, against Snakemake's own ``expand``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from snakemake.io import expand

from kpca_repro.analysis import tables
from kpca_repro.workflow import paths

from conftest import register_rule_targets

REPO = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
register_rule_targets(REPO)  # the default_target calls of the rule files, as Snakemake runs them


def _config(**sections) -> dict:
    cfg = copy.deepcopy(BASE)
    for key, value in sections.items():
        cfg[key].update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    return cfg


@pytest.mark.parametrize("shards", [1, 3])
def test_shard_files_are_what_expand_gives(shards):
    cfg = _config(vision={"shards": shards, "n_images": 7}, text={"shards": shards, "n_rows": 9}, spectra={"n_images": 5})
    sh = [f"{i}of{shards}" for i in range(shards)]
    assert paths.vision_shards(cfg) == sh and paths.text_shards(cfg) == sh
    assert paths.heads_files(cfg, "paper", "m", "json") == expand("results/heads/{variant}/{model}/vision_{n}_{shard}.json", variant="paper", model="m", n=7, shard=sh)
    for keys in ("raw", ["standardized", "raw"]):
        assert paths.spectra_files(cfg, "corrected", "m", keys) == expand(
            "results/spectra/{variant}/{model}/vision_{n}_{shard}_{keyset}.csv", variant="corrected", model="m", n=5, shard=sh, keyset=keys
        )
    assert paths.text_stage_files(cfg, "org/name") == expand("results/activations/org--name/text_9_{shard}.h5", shard=sh)
    assert paths.text_stage_files(cfg, "org/name", "csv", "paper") == expand("results/heads/paper/org--name/text_9_{shard}.csv", shard=sh)
    assert paths.norm_activations(cfg, "vision", "corrected", "m") == expand("results/activations/m/vision_7_{shard}.h5", shard=sh)
    assert paths.norm_activations(cfg, "text", "paper", "s") == ["results/activations/s/text_sentences_0of1.h5"]


def test_slugs_round_trip():
    for model_id in ("sentence-transformers/all-MiniLM-L6-v2", "bert-base-uncased", "a/b_c.d"):
        assert paths.model_id_from_slug(paths.model_slug(model_id)) == model_id and "/" not in paths.model_slug(model_id)


def test_targets_follow_the_configuration():
    """Rule all builds what the rule files registered: every table and figure of the configured
    variants, the report's HTML of each table, last the comparison with the paper."""
    full = paths.all_targets(BASE)
    assert full[-1] == "results/paper_comparison.csv" and len(full) == len(set(full))
    for f in ("results/table4.csv", "results/table4_corrected.md", "results/figure5_corrected.pdf", "results/html/table4.html", "results/figure1.pdf"):
        assert f in full
    vision_only = paths.all_targets(_config(text={"models": []}, variants=["paper"], figure1={"runs": [], "use_reference": False}))
    assert not any("table4" in t or "figure5" in t or "_corrected" in t or "figure1" in t for t in vision_only)
    assert paths.comparison_tables(_config(variants=["paper"], text={"models": []})) == {t: (f"results/{t}.csv", None) for t in ("table1", "table2", "table3")}
    assert paths.comparison_tables(BASE)["table4"] == ("results/table4.csv", "results/table4_corrected.csv")


def test_every_table_is_in_rule_all_and_the_report():
    """Rule all builds each table of the registry whose models are configured, its CSV, Markdown
    and report page (results/html/, written by rule table with the CSV) per variant."""
    full = paths.all_targets(BASE)
    for name in tables.TABLES:
        for suffix in ("", "_corrected"):
            assert {f"results/{name}{suffix}.csv", f"results/{name}{suffix}.md", f"results/html/{name}{suffix}.html"} <= set(full)


def test_a_new_table_is_one_registry_entry(monkeypatch):
    """A toy table registered with its row function alone: rule all builds it for every variant,
    with its report page; it is compared with the paper; it reads the per-head
    records (and, in the paper variant, the sign draws) of its domain's models, in their order."""
    toy = tables.Table("table9", "text", lambda heads, kept, meta: {"n_heads": len(heads)}, (("MDC", "direct_cos_max", "max"),), published="table9.csv", caption="**Table 9.**")
    monkeypatch.setitem(tables.TABLES, "table9", toy)
    full = paths.all_targets(BASE)
    assert {"results/table9.csv", "results/table9_corrected.md", "results/html/table9_corrected.html"} <= set(full)
    assert paths.comparison_tables(BASE)["table9"] == ("results/table9.csv", "results/table9_corrected.csv")
    no_text = _config(text={"models": []})
    assert not any("table9" in t for t in paths.all_targets(no_text)) and "table9" not in paths.comparison_tables(no_text)
    cfg = _config(text={"models": ["org/b", "a"], "shards": 2, "n_rows": 5})
    paper = paths.table_inputs(cfg, toy, "paper")
    assert paper["heads"] == expand("results/heads/paper/{slug}/text_5_{shard}.csv", slug=["org--b", "a"], shard=["0of2", "1of2"])
    assert paper["meta"] == [f.replace(".csv", ".json") for f in paper["heads"]] and paper["signs"] == [f.replace(".csv", "_signs.h5") for f in paper["heads"]]
    assert paper["columns"] == [f"{f}-metadata.json" for f in paper["heads"]]  # rule records_metadata, built with the table
    assert set(paths.table_inputs(cfg, toy, "corrected")) == {"heads", "meta", "columns"}
    for bad in (("paper_comparison", "vision"), ("table9", "audio")):  # another rule's file name; no models to read
        with pytest.raises(ValueError, match="table<N>"):
            tables.Table(*bad, toy.row)
    cfg = _config(vision={"models": ["m", "n"], "shards": 2}, spectra={"n_images": 5})
    spectra = expand("results/spectra/corrected/{model}/vision_5_{shard}_{keys}.csv", model=["m", "n"], shard=["0of2", "1of2"], keys=["standardized", "raw"])
    columns = [f"{f}-metadata.json" for f in spectra]
    assert paths.table_inputs(cfg, tables.TABLES["table3"], "corrected") == {"records": spectra, "columns": columns}  # model, then shard, then keys
