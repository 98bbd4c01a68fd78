"""kpca_repro.workflow.paths: the workflow's file layout, against Snakemake's own ``expand``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from snakemake.io import expand

from kpca_repro.workflow import paths

REPO = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
paths.register_rule_targets(REPO)  # the default_target calls of the rule files, as Snakemake runs them


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
    assert paths.comparison_tables(_config(variants=["paper"], text={"models": []})) == {t: (f"results/table{t}.csv", None) for t in "123"}


def test_a_table_registers_itself_in_its_rule_file():
    """A rule file's default_target call alone puts a table into rule all and the report."""
    for name in ("table1", "table2", "table3", "table4", "paper_comparison"):
        assert name in paths.REPORT_TABLES and f"{name}_corrected" in paths.REPORT_TABLES or name == "paper_comparison"
    before = list(paths.REPORT_TABLES)
    try:
        paths.default_target("results/table9{suffix}.csv", "results/table9{suffix}.md", report=True, when=lambda config: bool(config["vision"]["models"]))
        full = paths.all_targets(BASE)
        assert {"results/table9.csv", "results/table9_corrected.md", "results/html/table9_corrected.html"} <= set(full) and "table9" in paths.REPORT_TABLES
        assert not any("table9" in t for t in paths.all_targets(_config(vision={"models": []})))
    finally:
        paths._TARGETS.pop(("results/table9{suffix}.csv", "results/table9{suffix}.md"))
        paths.REPORT_TABLES[:] = before
